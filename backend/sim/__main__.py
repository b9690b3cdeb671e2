"""python -m backend.sim: replay a mixed open-loop trace through the real scheduler."""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from backend.config import EngineConfig
from backend.sim.cost import H100, H200, LLAMA3_8B, CostModel
from backend.sim.report import summarize
from backend.sim.simulator import Simulator
from backend.sim.trace import Stream, make_trace

GPUS = {"h100": H100, "h200": H200}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m backend.sim",
        description="Replay an open-loop trace (Poisson chat traffic over three tenants and "
        "priorities 0/2/5, document traffic with a burst, cancellations) through the real "
        "Scheduler and BlockManager on a virtual clock, with a roofline cost model of a "
        "Llama-3-8B-like model on one GPU. Prints TTFT, ITL and queue time p50/p95/p99 per "
        "class and priority, goodput, rejections, preemptions and the worst wait of the "
        "lowest priority.",
    )
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat-rate", type=float, default=6.0, help="chat requests/s, all tenants")
    p.add_argument("--doc-rate", type=float, default=0.3, help="document requests/s")
    p.add_argument("--burst-rate", type=float, default=3.0, help="documents/s during the burst")
    p.add_argument("--cancel", type=float, default=0.05, help="share of chats abandoned")
    p.add_argument("--chat-deadline", type=float, default=None, help="first-token deadline, s")
    p.add_argument("--max-waiting-requests", type=int, default=1024)
    p.add_argument("--gpu", choices=sorted(GPUS), default="h100")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--no-aging", action="store_true")
    p.add_argument("--no-fairness", action="store_true")
    p.add_argument("--no-protection", action="store_true", help="no prefill reserve or cap")
    p.add_argument("--no-priority-preemption", action="store_true")
    return p.parse_args()


def streams(args: argparse.Namespace) -> list[Stream]:
    end = args.duration
    chat = Stream("chat", args.chat_rate / 3, (100, 300), (100, 300), end=end)
    chats = [
        replace(
            chat,
            tenant=tenant,
            priority=priority,
            cancel_fraction=args.cancel,
            deadline_s=args.chat_deadline,
        )
        for tenant, priority in (("acme", 0), ("globex", 2), ("initech", 5))
    ]
    docs = Stream(
        "document", args.doc_rate, (4000, 8000), (20, 60), end=end, tenant="globex", ttft_slo_s=10.0
    )
    burst = replace(docs, rate=args.burst_rate, start=end / 3, end=end / 3 + 5)
    return [*chats, docs, burst]


def main() -> None:
    args = parse()
    config = EngineConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_waiting_requests=args.max_waiting_requests,
        aging_interval_s=None if args.no_aging else EngineConfig.aging_interval_s,
        tenant_fairness=not args.no_fairness,
        prefill_reserve_share=0.0 if args.no_protection else EngineConfig.prefill_reserve_share,
        long_prefill_token_threshold=0 if args.no_protection else None,
        priority_preemption_gap=None if args.no_priority_preemption else 2,
    )
    cost = CostModel(LLAMA3_8B, GPUS[args.gpu])
    started = time.perf_counter()
    result = Simulator(config, cost).run(make_trace(streams(args), args.seed))
    print(summarize(result).format())
    print(f"(simulated in {time.perf_counter() - started:.1f} s of wall time)")


if __name__ == "__main__":
    main()
