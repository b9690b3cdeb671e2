"""Speculative decoding against plain decoding (issue 34), through the HTTP API: embedded
`tollgate serve` on loopback with the built-in model, one plain, one with
`--speculative-method ngram` and one with `--speculative-method draft`, all up in the same
run and measured alternately (each cell starting with the next side, so that none is
always measured last). The draft model is built here, nothing downloaded: the
built-in model cut to its first `--draft-layers` layers (the same embeddings, tied LM
head, final norm and tokenizer; an early exit, not a trained small model). At 1 and
8 concurrent streamed requests: output tok/s (every completion token over the wall time,
prefill included) and decode tok/s per stream (tokens after the first over the time from
the first to the last: what speculation speeds up), on two workloads:

- repetitive: stdlib source code and docstrings followed by their own first 80
  characters (a code edit or a summary that quotes its prompt), greedy;
- long_tailed: random token prompts of long-tailed lengths (median 200, up to 1,024)
  and outputs (median 48, up to 256), as bench/engine_throughput.py draws them, sampled
  at temperature 1: drafts are rarely accepted there, so speculation must turn itself
  down (target: no loss over 5%).

Target: at least 1.5x on the repetitive workload at concurrency 1.

    python -m bench.speculative [--repeat 2] [--tokens 128] [--k 4] [--methods ngram,draft]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import functools
import inspect
import json
import random
import shutil
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import httpx

from backend.builtin import BUILTIN_MODEL_DIR
from bench._common import long_tailed, truncated_draft
from bench.serve import Server, serving

Request = dict[str, Any]  # a /v1/completions body without "model"


def repetitive_work(tokens: int) -> list[Request]:
    """Eight texts from the standard library (code and prose), each followed by its own
    opening: the continuation quotes the prompt."""
    sources = [
        inspect.getsource(json.dumps),
        inspect.getsource(textwrap.wrap),
        inspect.getsource(functools.wraps),
        inspect.getsource(collections.namedtuple)[:1500],
        json.__doc__ or "",
        collections.__doc__ or "",
        inspect.__doc__ or "",
        inspect.getsource(random.Random.shuffle),
    ]
    return [
        {"prompt": text[:1200] + "\n\n" + text[:80], "max_tokens": tokens, "temperature": 0}
        for text in sources
    ]


def long_tailed_work(num: int, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    work = []
    for _ in range(num):
        prompt = long_tailed(rng, 32, 1024, median=200, sigma=0.9)
        output = long_tailed(rng, 16, 256, median=48, sigma=0.8)
        ids = [rng.randrange(3, 4000) for _ in range(prompt)]
        work.append({"prompt": ids, "max_tokens": output, "temperature": 1.0})
    return work


async def complete(server: Server, body: Request) -> tuple[int, float]:
    """One streamed completion: its completion tokens, and the seconds from its first
    streamed token to its last (its decode time)."""
    headers = {"Authorization": f"Bearer {server.key}"}
    full = {
        **body,
        "model": server.model,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    times: list[float] = []
    tokens = 0
    url = f"{server.base}/v1/completions"
    async with server.http.stream("POST", url, json=full, headers=headers) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = int(event["usage"]["completion_tokens"])
            if event.get("choices"):
                times.append(time.monotonic())
    return tokens, times[-1] - times[0]


async def rates(server: Server, work: list[Request], concurrency: int) -> tuple[float, float]:
    """`work` with `concurrency` requests in flight at a time: output tok/s (completion
    tokens over the wall time, prefill included) and decode tok/s per stream (tokens
    after the first over the time from the first to the last, summed over requests)."""
    queue = list(reversed(work))
    total = after_first = 0
    decoding = 0.0

    async def worker() -> None:
        nonlocal total, after_first, decoding
        while queue:
            tokens, seconds = await complete(server, queue.pop())
            total += tokens
            after_first += tokens - 1
            decoding += seconds

    started = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return total / (time.monotonic() - started), after_first / decoding


async def spec_stats(server: Server) -> dict[str, float]:
    """Acceptance figures from the server's /metrics (the engine's own names)."""
    text = (await server.http.get(f"{server.base}/metrics")).text
    found = {}
    for line in text.splitlines():
        for name in ("acceptance_ratio", "tokens_per_step"):
            if line.startswith(f"tollgate_engine_spec_decode_{name} "):
                found[name] = round(float(line.split()[-1]), 2)
    return found


async def run(args: argparse.Namespace) -> None:
    workloads = {
        "repetitive": repetitive_work(args.tokens),
        "long_tailed": long_tailed_work(16),
    }
    methods = [m for m in args.methods.split(",") if m]
    draft = Path(tempfile.mkdtemp(prefix="tollgate-bench-draft-"))
    truncated_draft(BUILTIN_MODEL_DIR, draft, args.draft_layers)
    async with httpx.AsyncClient(timeout=600) as http, contextlib.AsyncExitStack() as stack:
        stack.callback(shutil.rmtree, draft, True)
        servers = {
            method: await stack.enter_async_context(serving(http, settings(method, args.k, draft)))
            for method in ("off", *methods)
        }
        for server in servers.values():  # warm-up: first steps, allocator
            await rates(server, workloads["repetitive"][:2], 2)
        names, cell = list(servers), 0
        for attempt in range(args.repeat):
            report: dict[str, Any] = {"run": attempt + 1, "k": args.k}
            if "draft" in methods:
                report["draft_layers"] = args.draft_layers
            for workload, work in workloads.items():
                for concurrency in (1, 8):
                    output, decode = {}, {}
                    # Each cell starts with the next side: none is always measured last.
                    shift, cell = cell % len(names), cell + 1
                    for name in names[shift:] + names[:shift]:
                        got = await rates(servers[name], work, concurrency)
                        output[name], decode[name] = round(got[0], 1), round(got[1], 1)
                    key = f"{workload}_c{concurrency}"
                    report[f"{key}_output_tok_s"] = output
                    report[f"{key}_decode_tok_s"] = decode
                    for method in methods:
                        ratio = round(output[method] / output["off"], 2)
                        report[f"{key}_output_ratio_{method}"] = ratio
                        ratio = round(decode[method] / decode["off"], 2)
                        report[f"{key}_decode_ratio_{method}"] = ratio
            for method in methods:
                report[f"{method}_metrics"] = await spec_stats(servers[method])
            print(json.dumps(report), flush=True)


def settings(method: str, k: int, draft: Path) -> dict[str, str]:
    env = {"TOLLGATE_SPECULATIVE_METHOD": method, "TOLLGATE_NUM_SPECULATIVE_TOKENS": str(k)}
    if method == "draft":
        env["TOLLGATE_SPECULATIVE_MODEL"] = str(draft)
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128, help="per repetitive completion")
    parser.add_argument("--k", type=int, default=4, help="--num-speculative-tokens")
    parser.add_argument("--methods", default="ngram,draft", help="beside plain decoding")
    parser.add_argument(
        "--draft-layers", type=int, default=1, help="the built-in model's layers the draft keeps"
    )
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
