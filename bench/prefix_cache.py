"""Prefix caching: 64 requests that share a 1,024-token system prompt, each with its own
32-token question, sent one after another (concurrency 1, so TTFT is prefill time, not
queueing). Cold: the prefix cache is off and every request prefills all its tokens.
Warm: the cache is on; the first request computes the system prompt, the others find
its 64 blocks cached and prefill only their question. Prints the hit rate and TTFT p50.

    .venv/bin/python -m bench.prefix_cache [--quick]
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch

from backend.config import EngineConfig
from backend.engine.engine import Engine
from backend.requests import EngineRequest
from backend.sampling import SamplingParams
from bench._common import CACHE, build_random_llama, percentile

SYSTEM_TOKENS = 1024
QUESTION_TOKENS = 32


def run(model_dir: Path, prompts: list[list[int]], caching: bool) -> tuple[list[float], Engine]:
    config = EngineConfig(kv_cache_bytes=2**30, enable_prefix_caching=caching)
    engine = Engine(model_dir, config)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engine.add_request(
        EngineRequest(list(range(1000, 1064)), params, "warm-up")
    )  # unrelated tokens
    while engine.has_work():
        engine.step()
    ttfts = []
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(prompt, params, f"r{i}", tenant="acme"))
        first = None
        while engine.has_work():
            for out in engine.step():
                if first is None and out.first_token_time is not None:
                    first = out.first_token_time - out.arrival_time
        assert first is not None
        ttfts.append(first)
    return ttfts, engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="16 requests instead of 64")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    model_dir = build_random_llama(CACHE / "llama-8x512")
    rng = random.Random(0)
    system = [rng.randrange(2, 32000) for _ in range(SYSTEM_TOKENS)]
    num = args.requests or (16 if args.quick else 64)
    prompts = [
        system + [rng.randrange(2, 32000) for _ in range(QUESTION_TOKENS)] for _ in range(num)
    ]
    print(
        f"{num} requests: a shared {SYSTEM_TOKENS}-token system prompt "
        f"+ a {QUESTION_TOKENS}-token question each"
    )

    cold, _ = run(model_dir, prompts, caching=False)
    warm, engine = run(model_dir, prompts, caching=True)
    stats = engine.stats()
    warm_hits = stats.prefix_cache_hits
    # The warm-up request's own lookup (no hit) is part of the stats: leave it out.
    queries = stats.prefix_cache_queries - 64
    cold_p50, warm_p50 = percentile(cold, 50), percentile(warm, 50)
    print(
        f"prefix cache hit rate : {warm_hits / queries:6.1%} "
        f"({warm_hits} of {queries} prompt tokens)"
    )
    print(f"TTFT p50 cold (off)   : {cold_p50 * 1000:8.1f} ms")
    print(f"TTFT p50 warm (on)    : {warm_p50 * 1000:8.1f} ms")
    print(f"speed-up              : {cold_p50 / warm_p50:.1f}x lower TTFT")


if __name__ == "__main__":
    main()
