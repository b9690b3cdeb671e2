"""Throughput: this engine (continuous batching, paged KV, chunked prefill) against
transformers' generate() with static batching, on the same random 8-layer, 512-wide
Llama and the same mixed workload: 128 requests, long-tailed prompt lengths from 32 to
1,536 tokens, outputs of 16 to 256 tokens, EOS ignored, greedy.

Only the tokens each request asked for count as output; static batching also computes
padding and keeps generating for a batch's shorter requests until its longest is done,
which is what continuous batching avoids.

    .venv/bin/python -m bench.engine_throughput [--quick]
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from backend.config import EngineConfig
from backend.engine.engine import Engine
from backend.sampling import SamplingParams
from bench._common import CACHE, build_random_llama, long_tailed

Workload = list[tuple[list[int], int]]  # (prompt ids, output tokens)


def make_workload(num: int, max_prompt: int, max_output: int, seed: int, vocab: int) -> Workload:
    rng = random.Random(seed)
    work = []
    for _ in range(num):
        prompt_len = long_tailed(rng, 32, max_prompt, median=200, sigma=0.9)
        out_len = long_tailed(rng, 16, max_output, median=48, sigma=0.8)
        work.append(([rng.randrange(2, vocab) for _ in range(prompt_len)], out_len))
    return work


def run_engine(model_dir: Path, work: Workload, config: EngineConfig) -> tuple[int, float]:
    engine = Engine(model_dir, config)
    warm = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engine.add_request("warm-up", work[0][0][:64], warm)
    while engine.has_work():
        engine.step()
    start, cpu = time.perf_counter(), time.process_time()
    for i, (prompt, out_len) in enumerate(work):
        params = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
        engine.add_request(f"r{i}", prompt, params)
    tokens = 0
    while engine.has_work():
        tokens += sum(len(o.token_ids) for o in engine.step())
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    stats = engine.stats()
    print(
        f"  engine: {stats.num_steps} steps, {stats.num_preemptions} preemptions, "
        f"{stats.total_prefill_tokens} prefill + {stats.total_decode_tokens} decode tokens, "
        f"{cpu:.1f} s CPU"
    )
    return tokens, elapsed


def run_static(model_dir: Path, work: Workload, batch_size: int) -> tuple[int, float]:
    """generate() on fixed batches in arrival order: left-padded prompts, every request
    in a batch generating until the batch's longest output is done."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()  # type: ignore[no-untyped-call]
    with torch.inference_mode():
        model.generate(torch.tensor([work[0][0][:64]]), max_new_tokens=4, do_sample=False)
        start, cpu = time.perf_counter(), time.process_time()
        padded = 0
        for b in range(0, len(work), batch_size):
            batch = work[b : b + batch_size]
            width = max(len(p) for p, _ in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for row, (prompt, _) in enumerate(batch):
                ids[row, width - len(prompt) :] = torch.tensor(prompt)
                mask[row, width - len(prompt) :] = 1
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max(n for _, n in batch),
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            longest = max(n for _, n in batch)
            if out.shape[1] != width + longest:  # stopped early: that would flatter it
                raise RuntimeError(f"generate() made {out.shape[1] - width} of {longest} tokens")
            padded += len(batch) * (width + longest)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    useful = sum(len(p) + n for p, n in work)
    print(f"  static: {padded} padded token slots for {useful} useful ones, {cpu:.1f} s CPU")
    return sum(n for _, n in work), elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="32 requests, shorter lengths")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--static-batch-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-static", action="store_true")
    parser.add_argument("--skip-engine", action="store_true")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    model_dir = build_random_llama(CACHE / "llama-8x512")
    num, max_prompt, max_output = (32, 512, 64) if args.quick else (128, 1536, 256)
    work = make_workload(args.requests or num, max_prompt, max_output, args.seed, 32000)
    prompt_tokens = sum(len(p) for p, _ in work)
    print(
        f"{len(work)} requests: {prompt_tokens} prompt tokens "
        f"(max {max(len(p) for p, _ in work)}), {sum(n for _, n in work)} output tokens "
        f"(max {max(n for _, n in work)}); {args.threads} threads"
    )
    config = EngineConfig(
        kv_cache_bytes=2 * 2**30,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    engine_tps = 0.0
    if not args.skip_engine:
        tokens, seconds = run_engine(model_dir, work, config)
        engine_tps = tokens / seconds
        print(
            f"tollgate engine : {tokens} output tokens in {seconds:7.1f} s "
            f"= {engine_tps:7.1f} tok/s"
        )
    if args.skip_static:
        return
    tokens, seconds = run_static(model_dir, work, args.static_batch_size)
    static_tps = tokens / seconds
    print(
        f"static batching : {tokens} output tokens in {seconds:7.1f} s = {static_tps:7.1f} tok/s "
        f"(transformers generate, batches of {args.static_batch_size})"
    )
    if engine_tps:
        print(f"ratio           : {engine_tps / static_tps:.2f}x")


if __name__ == "__main__":
    main()
