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
import json
import os
import secrets
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench._common import build_random_llama
from bench.hostile_load import start_server, tenant_key, wait_ready
from tenants import keys

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


async def decode_rate(
    http: httpx.AsyncClient, server: dict[str, str], concurrency: int, tokens: int
) -> float:
    """Output tok/s of `concurrency` streams decoding together (first token excluded)."""
    runs = [
        stream_tokens(http, server["base"], server["key"], server["model"], tokens)
        for _ in range(concurrency)
    ]
    started = time.monotonic()
    done = await asyncio.gather(*runs)
    total = sum(n for n, _ in done)
    decoding = max(s for _, s in done) or time.monotonic() - started
    return total / decoding


async def start(
    folder: Path, model_dir: Path, quantization: str, http: httpx.AsyncClient
) -> tuple[Any, dict[str, str]]:
    admin, _ = keys.generate_key()
    port = 18000 + secrets.randbelow(2000)
    base = f"http://127.0.0.1:{port}"
    os.environ["TOLLGATE_MODEL"] = str(model_dir)
    os.environ["TOLLGATE_QUANTIZATION"] = quantization
    process = start_server(folder, admin, port)
    await wait_ready(http, base, timeout_s=300)
    auth = {"Authorization": f"Bearer {admin}"}
    model = (await http.get(f"{base}/v1/models", headers=auth)).json()["data"][0]["id"]
    key = await tenant_key(http, base, admin, None)
    return process, {"base": base, "key": key, "model": model}


async def run(args: argparse.Namespace) -> None:
    model_dir = build_random_llama(Path(tempfile.gettempdir()) / "tollgate-bench-q", **CHECKPOINT)
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        async with httpx.AsyncClient(timeout=600) as http:
            servers, processes = {}, []
            try:
                for name, folder in (("none", a), ("int8", b)):
                    process, servers[name] = await start(Path(folder), model_dir, name, http)
                    processes.append(process)
                for server in servers.values():  # warm-up: first steps, allocator
                    await decode_rate(http, server, 2, 16)
                for attempt in range(args.repeat):
                    report: dict[str, Any] = {"run": attempt + 1, "tokens": args.tokens}
                    for concurrency in (1, 16):
                        rates = {
                            name: round(await decode_rate(http, s, concurrency, args.tokens), 1)
                            for name, s in servers.items()
                        }
                        report[f"batch_{concurrency}_tok_s"] = rates
                        report[f"batch_{concurrency}_ratio"] = round(
                            rates["int8"] / rates["none"], 2
                        )
                    print(json.dumps(report), flush=True)
            finally:
                for process in processes:
                    process.terminate()
                    process.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128, help="per completion")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
