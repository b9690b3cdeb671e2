"""Scheduling policy comparisons in the simulator (backend/sim): the real Scheduler and
BlockManager on a virtual clock, a roofline cost model of a Llama-3-8B-like model on one
H100-like GPU, and seeded Poisson traces. Each line compares a policy on and off on the
same trace (backend/sim/scenarios.py), the baseline in the same run:

- aging: worst queue time of priority 5 under a priority-0 flood, against the documented
  starvation bound p * I + (ceil(Q / S) + 1) * R;
- prefill protection: chat TTFT p95 through a burst of 7k-token documents, against chat
  alone;
- fairness: share of scheduled tokens of two equal-weight tenants, one sending 10x the
  other's requests, while both wait (and with weights 3:1);
- priority preemption: steps from arrival to first schedule of priority-0 requests that
  find max_num_seqs full of priority 5;
- shedding: requests shed per class under the priority-0 flood, when a full queue refuses
  newcomers and when it sheds its least urgent first;
- the scheduler's own cost: wall time per schedule() step of the simulated mixed trace;
- latency targets (issue 15), on a CPU-like fitted cost: chat TTFT p90 and ITL p95
  alone and beside 1,800-token documents, adaptive and static budgets; the documents'
  throughput; a late tenant's makespan beside another's 10x burst;
- fair share against a backlog (issue 32 item 4), in-simulator on the H100-like roofline
  with the default config: tenant C's chat TTFT p50/p95 alone and beside tenant B's 200
  requests of 1,500 tokens (those C sends while B is unfinished), C at priority 4 and 0.

    .venv/bin/python -m bench.scheduler_sim [--seeds N]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from backend.config import EngineConfig
from backend.sim import Simulator, Stream, make_trace, summarize
from backend.sim import scenarios as sc
from backend.sim.report import of_stream, percentile, queue_time, residency, starvation_bound
from backend.sim.simulator import SimResult


def aging(seed: int) -> str:
    config, _ = sc.starvation(aging=True)
    on, off = sc.simulate(sc.starvation(True), seed), sc.simulate(sc.starvation(False), seed)
    bound = starvation_bound(config, 5, on)
    worst_on = max(queue_time(r) for r in of_stream(on, "batch"))
    worst_off = max(queue_time(r) for r in of_stream(off, "batch"))
    return (
        f"aging       worst p5 wait: off {worst_off:6.2f} s | on {worst_on:5.2f} s "
        f"(bound {bound:.2f} s, R = {residency(on):.2f} s)"
    )


def protection(seed: int) -> str:
    def p95(result: SimResult) -> float:
        return percentile(
            [r.first_token - r.arrival.time for r in of_stream(result, "chat") if r.first_token], 95
        )

    alone = p95(sc.simulate(sc.document_burst(True, documents=False), seed))
    on = p95(sc.simulate(sc.document_burst(True), seed))
    off = p95(sc.simulate(sc.document_burst(False), seed))
    return (
        f"protection  chat TTFT p95: alone {alone * 1000:5.1f} ms | burst, on "
        f"{on * 1000:5.1f} ms ({on / alone:.2f}x) | burst, off {off * 1000:6.1f} ms "
        f"({off / alone:.1f}x)"
    )


def fairness(seed: int) -> str:
    def quiet_share(scenario: tuple[EngineConfig, list[Stream]]) -> float:
        tokens = sc.simulate(scenario, seed).contended_tokens
        return tokens["quiet"] / sum(tokens.values())

    config, streams = sc.flood(True)
    weighted = [
        replace(s, weight=3, rate=2 * s.rate) if s.tenant == "quiet" else s for s in streams
    ]
    return (
        f"fairness    quiet tenant's token share (1/11 of requests): off "
        f"{quiet_share(sc.flood(False)):.1%} | on {quiet_share(sc.flood(True)):.1%} | "
        f"weight 3:1 {quiet_share((config, weighted)):.1%}"
    )


def preemption(seed: int) -> str:
    config, streams = sc.inversion()

    def steps(result: SimResult) -> tuple[int, int]:
        waits = [
            r.first_step - r.arrival_step
            for r in of_stream(result, "urgent")
            if r.first_step is not None
        ]
        return max(waits), len(waits)

    on = sc.simulate((config, streams), seed)
    off = sc.simulate((replace(config, priority_preemption_gap=None), streams), seed)
    (worst_on, n), (worst_off, _) = steps(on), steps(off)
    return (
        f"preemption  steps to start for {n} urgent requests: off {worst_off} | on {worst_on} "
        f"({on.num_priority_preemptions} preemptions)"
    )


def shedding(seed: int) -> str:
    def shed(result: SimResult, name: str) -> str:
        records = of_stream(result, name)
        return f"{sum(r.outcome == 'overloaded' for r in records)}/{len(records)}"

    refusing = sc.simulate(sc.starvation(True), seed)
    displacing = sc.simulate(sc.starvation(True, displace=True), seed)
    return (
        f"shedding    full queue, shed p0 | p5: newcomers refused {shed(refusing, 'chat')} | "
        f"{shed(refusing, 'batch')}; least urgent first {shed(displacing, 'chat')} | "
        f"{shed(displacing, 'batch')}"
    )


def overhead(seed: int) -> str:
    config = EngineConfig(max_num_seqs=128, max_num_batched_tokens=512)
    chat = Stream("chat", 2.0, (100, 300), (100, 300), end=60.0)
    streams = [
        replace(chat, tenant=tenant, priority=priority, cancel_fraction=0.05)
        for tenant, priority in (("acme", 0), ("globex", 2), ("initech", 5))
    ]
    streams.append(Stream("document", 0.3, (4000, 8000), (20, 60), end=60.0, ttft_slo_s=10.0))
    trace = make_trace(streams, seed)
    started = time.perf_counter()
    result = Simulator(config).run(trace)
    wall = time.perf_counter() - started
    report = summarize(result)
    return (
        f"overhead    {wall / result.num_steps * 1e6:.0f} us of scheduler + simulator per step "
        f"({result.num_steps} steps, {len(trace)} requests)\n\n{report.format()}"
    )


def latency(seed: int) -> str:
    def chat(result: SimResult) -> tuple[float, float]:
        chats = of_stream(result, "chat")
        ttft = [r.first_token - r.arrival.time for r in chats if r.first_token is not None]
        gaps = [
            b - a for r in chats for a, b in zip(r.token_times, r.token_times[1:], strict=False)
        ]
        return percentile(ttft, 90), percentile(gaps, 95)

    def docs(result: SimResult) -> float:
        done = [r for r in of_stream(result, "document") if r.outcome == "finished"]
        return sum(r.arrival.prompt_tokens for r in done) / max(r.end or 0.0 for r in done)

    (ttft0, itl0) = chat(sc.simulate_on(sc.cpu_document_flood(True, documents=False), seed))
    on, off = (sc.simulate_on(sc.cpu_document_flood(a), seed) for a in (True, False))
    (ttft1, itl1), (ttft2, itl2) = chat(on), chat(off)
    late = [sc.late_makespan(a, f, seed) for a in (True, False) for f in (0, 160)]
    return (
        f"latency     chat TTFT p90 alone {ttft0 * 1000:.0f} ms, beside documents: adaptive "
        f"{ttft1 * 1000:.0f} ms ({ttft1 / ttft0:.1f}x), static {ttft2 * 1000:.0f} ms "
        f"({ttft2 / ttft0:.1f}x)\n"
        f"            chat ITL p95 alone {itl0 * 1000:.0f} ms, beside documents: adaptive "
        f"{itl1 * 1000:.0f} ms, static {itl2 * 1000:.0f} ms; document throughput adaptive / "
        f"static {docs(on) / docs(off):.0%}\n"
        f"            late tenant makespan, alone / beside 160: adaptive {late[0]:.2f} / "
        f"{late[1]:.2f} s ({late[1] / late[0]:.1f}x), static {late[2]:.2f} / {late[3]:.2f} s "
        f"({late[3] / late[2]:.1f}x)"
    )


def fair_backlog(seed: int) -> str:
    lines = []
    for priority, slots in ((4, None), (0, None), (4, 32)):
        alone = sc.fair_backlog_ttft(0, priority, seed, slots)
        beside = sc.fair_backlog_ttft(200, priority, seed, slots)
        p50s = [percentile(t, 50) * 1000 for t in (alone, beside)]
        p95s = [percentile(t, 95) * 1000 for t in (alone, beside)]
        lines.append(
            f"C at p{priority}, max_num_seqs {slots or 'default'}: TTFT alone p50/p95 "
            f"{p50s[0]:.1f}/{p95s[0]:.1f} ms | beside B ({len(beside)} chats) "
            f"{p50s[1]:.1f}/{p95s[1]:.1f} ms | p95 ratio {p95s[1] / p95s[0]:.1f}x"
        )
    return "fair share  (in-simulator, H100-like roofline)\n            " + "\n            ".join(
        lines
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=1, help="repeat each line with seeds 0..N-1")
    args = parser.parse_args()
    for seed in range(args.seeds):
        print(f"seed {seed}")
        for line in (
            aging,
            protection,
            fairness,
            preemption,
            shedding,
            latency,
            fair_backlog,
            overhead,
        ):
            print(line(seed), flush=True)


if __name__ == "__main__":
    main()
