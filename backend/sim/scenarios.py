"""The policy comparisons the tests assert and bench/scheduler_sim.py prints. Each returns
the engine config and the streams; `simulate` replays them."""

from __future__ import annotations

import math
import random
from dataclasses import replace

from backend.config import EngineConfig
from backend.engine.step_cost import StepCostModel
from backend.sim.simulator import SimResult, Simulator
from backend.sim.trace import Arrival, Stream, make_trace

# A latency-oriented engine: 512-token steps (vLLM's former chunked-prefill default).
BASE = EngineConfig(block_size=16, max_num_seqs=128, max_num_batched_tokens=512)
CHAT = Stream("chat", rate=8.0, prompt_tokens=(100, 300), output_tokens=(100, 300), end=30.0)
DOCUMENT = Stream(
    "document", rate=0.0, prompt_tokens=(6000, 8000), output_tokens=(20, 50), ttft_slo_s=10.0
)

STARVATION_INTERVAL_S = 1.0


def simulate(scenario: tuple[EngineConfig, list[Stream]], seed: int = 0) -> SimResult:
    config, streams = scenario
    return Simulator(config).run(make_trace(streams, seed))


def starvation(aging: bool, displace: bool = False) -> tuple[EngineConfig, list[Stream]]:
    """Priority-0 chat at about 1.3x what 16 slots serve, for 30 s; a trickle of priority-5
    requests alongside. Without aging the trickle waits for the flood to end. `displace`:
    the full queue sheds priority 5 for priority 0 (shed_least_urgent_first)."""
    config = replace(
        BASE,
        max_num_seqs=16,
        max_waiting_requests=48,
        aging_interval_s=STARVATION_INTERVAL_S if aging else None,
        shed_least_urgent_first=displace,
    )
    flood = Stream("chat", rate=16.0, prompt_tokens=(200, 400), output_tokens=(100, 150), end=30.0)
    low = replace(flood, name="batch", rate=0.5, priority=5, end=25.0)
    return config, [flood, low]


def document_burst(protection: bool, documents: bool = True) -> tuple[EngineConfig, list[Stream]]:
    """Steady chat; from t=10 s to 15 s a burst of 7k-token documents (3 per second).
    256-token steps: a full step costs little more than a chat's own prefill step, which
    is what keeps TTFT near its unloaded value once chats skip the documents' queue."""
    config = replace(BASE, max_num_batched_tokens=256)
    if not protection:  # no reserve, no long-prefill cap, no express lane
        config = replace(
            config,
            prefill_reserve_share=0.0,
            long_prefill_token_threshold=0,
            adaptive_step_budget=False,
        )
    burst = replace(DOCUMENT, rate=3.0 if documents else 0.0, start=10.0, end=15.0)
    return config, [CHAT, burst]


def flood(fair: bool) -> tuple[EngineConfig, list[Stream]]:
    """Two tenants of equal weight, both past their share; one sends 10x the requests."""
    config = replace(BASE, max_num_seqs=32, max_waiting_requests=100_000, tenant_fairness=fair)
    quiet = replace(CHAT, name="quiet", tenant="quiet", rate=30.0, end=6.0)
    loud = replace(quiet, name="loud", tenant="loud", rate=300.0)
    return config, [loud, quiet]


def inversion() -> tuple[EngineConfig, list[Stream]]:
    """max_num_seqs full of long priority-5 work; priority-0 requests arrive meanwhile."""
    config = replace(BASE, max_num_seqs=8)
    low = Stream(
        "batch", rate=20.0, prompt_tokens=(100, 200), output_tokens=(500, 800), end=1.0, priority=5
    )
    urgent = Stream(
        "urgent", rate=2.0, prompt_tokens=(50, 100), output_tokens=(10, 20), start=1.5, end=4.0
    )
    return config, [low, urgent]


# A CPU-like machine, the shape a fit on the 8-layer, 512-wide random Llama gives here:
# 15 ms per step, 1.1 ms per prompt token, 1 ms per decode row (attention small).
CPU_LIKE = {
    "overhead": 0.015,
    "prefill_token": 0.0011,
    "decode_row": 0.001,
    "decode_context_token": 1e-9,
    "prefill_pair": 1e-9,
}


def cpu_document_flood(
    adaptive: bool, documents: bool = True
) -> tuple[EngineConfig, list[Stream], StepCostModel]:
    """Default settings on a CPU-like cost: steady chat (prompts 50-150 tokens, 32-64
    out) beside 1,800-token documents at about 80% of what the machine prefills; the
    issue 15 failure when the budget is static."""
    config = replace(EngineConfig(), num_kv_blocks=20_000, adaptive_step_budget=adaptive)
    chat = Stream(
        "chat", rate=2.0, prompt_tokens=(50, 150), output_tokens=(32, 64), end=30.0, tenant="chat"
    )
    docs = Stream(
        "document",
        rate=0.4 if documents else 0.0,
        prompt_tokens=(1700, 1900),
        output_tokens=(8, 16),
        end=30.0,
        tenant="docs",
        ttft_slo_s=30.0,
    )
    return config, [chat, docs], StepCostModel.fixed(CPU_LIKE)


def simulate_on(
    scenario: tuple[EngineConfig, list[Stream], StepCostModel], seed: int = 0
) -> SimResult:
    config, streams, cost = scenario
    return Simulator(config, cost).run(make_trace(streams, seed))


def late_tenant(flood: int, late: int = 16, seed: int = 0) -> list[Arrival]:
    """`flood` short requests from one tenant at t = 0, then `late` from another at
    t = 0.3 s (32-64-token prompts, 16-32 tokens out): issue 15's slot-share case."""
    rng = random.Random(seed)
    arrivals = []
    for tenant, count, start in (("flood", flood, 0.0), ("late", late, 0.3)):
        stream = Stream(tenant, 0.0, (32, 64), (16, 32), tenant=tenant)
        for i in range(count):
            prompt, output = rng.randint(32, 64), rng.randint(16, 32)
            arrivals.append(Arrival(start + i * 1e-4, f"{tenant}-{i}", stream, prompt, output))
    return sorted(arrivals, key=lambda a: a.time)


def late_makespan(adaptive: bool, flood: int, seed: int = 0) -> float:
    """The late tenant's makespan (its arrival to its last request's end) on the
    CPU-like cost, beside `flood` requests of another tenant."""
    config = replace(EngineConfig(), num_kv_blocks=20_000, adaptive_step_budget=adaptive)
    result = Simulator(config, StepCostModel.fixed(CPU_LIKE)).run(late_tenant(flood, seed=seed))
    ends = [r.end or 0.0 for r in result.records.values() if r.arrival.stream.name == "late"]
    return max(ends) - 0.3


def fair_backlog(backlog: int, c_priority: int = 4, seed: int = 0) -> list[Arrival]:
    """Issue 32 item 4 on the default engine: tenant B's `backlog` long requests (1,500
    tokens out) at priority 4, all at t = 0; tenant C's short chats (4-16 tokens out),
    Poisson 1/s for 60 s at `c_priority`."""
    rng = random.Random(seed)
    backlog_stream = Stream("backlog", 0.0, (50, 150), (1500, 1500), priority=4, tenant="b")
    arrivals = [
        Arrival(i * 1e-4, f"backlog-{i}", backlog_stream, rng.randint(50, 150), 1500)
        for i in range(backlog)
    ]
    chat = Stream("chat", 1.0, (50, 150), (4, 16), end=60.0, priority=c_priority, tenant="c")
    return sorted(arrivals + make_trace([chat], seed), key=lambda a: a.time)


def fair_backlog_ttft(
    backlog: int, c_priority: int = 4, seed: int = 0, max_num_seqs: int | None = None
) -> list[float]:
    """C's TTFTs in `fair_backlog` on the H100-like roofline and the default config (or
    `max_num_seqs` running, 32 being the CPU's default: the rest of B's backlog waits)."""
    config = replace(EngineConfig(), max_num_seqs=max_num_seqs)
    return chats_beside_backlog(Simulator(config).run(fair_backlog(backlog, c_priority, seed)))


def chats_beside_backlog(result: SimResult) -> list[float]:
    """TTFTs of C's chats that arrive while B still has requests unfinished (all of them
    when there is no backlog): B's 200 streams end within about 25 s on the roofline."""
    records = result.records.values()
    ends = [r.end or 0.0 for r in records if r.arrival.stream.tenant == "b"]
    backlog_end = max(ends, default=math.inf)
    return [
        r.first_token - r.arrival.time
        for r in records
        if r.arrival.stream.tenant == "c" and r.first_token and r.arrival.time < backlog_end
    ]
