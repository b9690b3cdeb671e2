"""Weight-only int8 against the engine's default dtype (issue 34), through the HTTP API:
two `tollgate serve` (embedded default) on loopback, the same checkpoint, one with
`--quantization int8`, measured in the same run, alternating. The checkpoint is a random
Llama the script builds (12 layers, 1024 wide, 2816 intermediate, 32k vocabulary:
~200M parameters, ~400 MB in bfloat16), large enough that a CPU decode step reads its
weights from memory (the built-in 2.4M-parameter model fits in cache and would show
nothing). Decode tok/s of streamed completions of 128 tokens, at 1 and 16 concurrent.

    python -m bench.quantization [--repeat 2] [--tokens 128]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench._common import build_random_llama
from bench.serve import Server, serving

CHECKPOINT = {"layers": 12, "hidden": 1024, "heads": 16, "kv_heads": 4, "intermediate": 2816}


async def stream_tokens(
    http: httpx.AsyncClient, base: str, key: str, model: str, tokens: int
) -> tuple[int, float]:
    """One streamed completion: (tokens after the first, seconds from the first to the
    last), the decode part of its time."""
    body = {
        "model": model,
        "prompt": list(range(10, 42)),
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {key}"}
    times: list[float] = []
    url = f"{base}/v1/completions"
    async with http.stream("POST", url, json=body, headers=headers) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if line.startswith("data: {"):
                times.append(time.monotonic())
    return len(times) - 1, times[-1] - times[0]


async def decode_rate(server: Server, concurrency: int, tokens: int) -> float:
    """Output tok/s of `concurrency` streams decoding together (first token excluded)."""
    runs = [
        stream_tokens(server.http, server.base, server.key, server.model, tokens)
        for _ in range(concurrency)
    ]
    started = time.monotonic()
    done = await asyncio.gather(*runs)
    total = sum(n for n, _ in done)
    decoding = max(s for _, s in done) or time.monotonic() - started
    return total / decoding


async def run(args: argparse.Namespace) -> None:
    model_dir = build_random_llama(Path(tempfile.gettempdir()) / "tollgate-bench-q", **CHECKPOINT)
    async with httpx.AsyncClient(timeout=600) as http, contextlib.AsyncExitStack() as stack:
        servers = {
            name: await stack.enter_async_context(
                serving(http, {"TOLLGATE_MODEL": str(model_dir), "TOLLGATE_QUANTIZATION": name})
            )
            for name in ("none", "int8")
        }
        for server in servers.values():  # warm-up: first steps, allocator
            await decode_rate(server, 2, 16)
        for attempt in range(args.repeat):
            report: dict[str, Any] = {"run": attempt + 1, "tokens": args.tokens}
            for concurrency in (1, 16):
                rates = await compare_rates(servers, concurrency, args.tokens)
                report[f"batch_{concurrency}_tok_s"] = rates
                report[f"batch_{concurrency}_ratio"] = round(rates["int8"] / rates["none"], 2)
            print(json.dumps(report), flush=True)


async def compare_rates(
    servers: dict[str, Server], concurrency: int, tokens: int
) -> dict[str, float]:
    """decode_rate on each server in turn, rounded."""
    return {n: round(await decode_rate(s, concurrency, tokens), 1) for n, s in servers.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128, help="per completion")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
