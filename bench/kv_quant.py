"""An int8 KV cache against bf16 (issue 34 item 2), through the HTTP API: two `tollgate
serve` (embedded default) on loopback, the same checkpoint and the same KV budget
(--kv-cache-bytes), bf16 compute, one with `--kv-cache-dtype int8`, measured in the same
run. The checkpoint is a random Llama the script builds with head_dim 128 (as Llama 3's:
the scales cost 4 / 128 of the values): 4 layers, 512 wide, 4 heads, 2 KV heads.

- Max concurrent sequences at 2k context: `--flood` requests of a 2,000-token prompt and
  48 output tokens (2,048 tokens each) sent at once, each prompt prefilled in one step
  (no long-prefill cap, no adaptive step budget), so a running request holds its whole
  prompt's KV; the most sequences decoding in one step (the
  tollgate_engine_step_tokens{kind="decode"} gauge, polled: each holds its whole prompt)
  against what its start-up line says (max_seqs_at_max_model_len at max_model_len
  2,048) and its KV blocks. The running gauge's peak is reported beside it: it is one
  higher, because a step that starts a 2,000-token prompt spends the rest of its
  2,048-token budget on the first chunk of the next prompt (a few blocks), which is
  counted as running until the pool runs short and preempts it.
- Decode tok/s of streamed completions (32-token prompt, `--tokens` out) at 1 and 8
  concurrent.

    python -m bench.kv_quant [--repeat 2] [--kv-cache-bytes 64MiB] [--flood 24]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import tempfile
from pathlib import Path
from typing import Any

import httpx

from bench._common import build_random_llama
from bench.quantization import compare_rates, decode_rate
from bench.serve import Server, serving

CHECKPOINT = {"layers": 4, "hidden": 512, "heads": 4, "kv_heads": 2, "intermediate": 1024}
VOCAB = 4096
CONTEXT = 2048
OUTPUT = 48  # a 2,000-token prompt: 125 blocks of 16, 128 once its output is in
RUNNING = re.compile(r"^tollgate_engine_requests_running (\S+)$", re.MULTILINE)
DECODING = re.compile(r'^tollgate_engine_step_tokens\{kind="decode"\} (\S+)$', re.MULTILINE)


def settings(model_dir: Path, kv: str, budget: str) -> dict[str, str]:
    return {
        "TOLLGATE_MODEL": str(model_dir),
        "TOLLGATE_DTYPE": "bfloat16",
        "TOLLGATE_KV_CACHE_DTYPE": kv,
        "TOLLGATE_KV_CACHE_BYTES": budget,
        "TOLLGATE_MAX_MODEL_LEN": str(CONTEXT),
        "TOLLGATE_MAX_NUM_SEQS": "64",  # the KV pool, not this cap, bounds the batch
        # Whole prompts in one step: a running request holds its prompt's KV (a chunked
        # one would run with a part of it, and preempt later).
        "TOLLGATE_LONG_PREFILL_TOKEN_THRESHOLD": "0",
        "TOLLGATE_ADAPTIVE_STEP_BUDGET": "false",
    }


async def long_request(server: Server, seed: int) -> None:
    prompt = [(seed * 7919 + i * 31) % (VOCAB - 10) + 5 for i in range(CONTEXT - OUTPUT)]
    body = {
        "model": server.model,
        "prompt": prompt,
        "max_tokens": OUTPUT,
        "ignore_eos": True,
    }
    headers = {"Authorization": f"Bearer {server.key}"}
    reply = await server.http.post(f"{server.base}/v1/completions", json=body, headers=headers)
    reply.raise_for_status()


async def max_running(server: Server, flood: int, run: int) -> tuple[int, int]:
    """The most sequences decoding in one step, and the most requests running, while
    `flood` 2k-token requests were in flight, from the gauges polled every 50 ms."""
    done = asyncio.Event()
    most = [0, 0]

    async def poll() -> None:
        while not done.is_set():
            text = (await server.http.get(f"{server.base}/metrics")).text
            for i, gauge in enumerate((DECODING, RUNNING)):
                most[i] = max([most[i], *(int(float(v)) for v in gauge.findall(text))])
            await asyncio.sleep(0.05)

    poller = asyncio.create_task(poll())
    try:
        # Prompts new to each run: no prefix-cache hit from the run before.
        await asyncio.gather(*(long_request(server, run * flood + i) for i in range(flood)))
    finally:
        done.set()
        await poller
    return most[0], most[1]


def startup_figure(line: str, name: str) -> int | None:
    found = re.search(rf"\b{name}=(\d+)", line)
    return int(found.group(1)) if found else None


async def run(args: argparse.Namespace) -> None:
    folder = Path(tempfile.gettempdir()) / "tollgate-bench-kvq"
    model_dir = build_random_llama(folder, **CHECKPOINT, vocab=VOCAB, max_positions=CONTEXT)
    async with httpx.AsyncClient(timeout=1800) as http, contextlib.AsyncExitStack() as stack:
        servers: dict[str, Server] = {}
        for name, kv in (("bf16", "auto"), ("int8", "int8")):
            env = settings(model_dir, kv, args.kv_cache_bytes)
            servers[name] = await stack.enter_async_context(serving(http, env))
            print(f"{name}: {servers[name].startup_line()}", flush=True)
        for server in servers.values():  # warm-up: first steps, allocator
            await decode_rate(server, 2, 16)
        for attempt in range(args.repeat):
            report: dict[str, Any] = {"run": attempt + 1, "context": CONTEXT}
            lines = {n: s.startup_line() for n, s in servers.items()}
            report["startup_max_seqs"] = {
                n: startup_figure(line, "max_seqs_at_max_model_len") for n, line in lines.items()
            }
            report["kv_blocks"] = {
                n: startup_figure(line, "kv_blocks") for n, line in lines.items()
            }
            peaks = {n: await max_running(s, args.flood, attempt) for n, s in servers.items()}
            report["max_decoding_measured"] = {n: p[0] for n, p in peaks.items()}
            report["max_running_gauge"] = {n: p[1] for n, p in peaks.items()}
            for concurrency in (1, 8):
                rates = await compare_rates(servers, concurrency, args.tokens)
                report[f"decode_{concurrency}_tok_s"] = rates
                report[f"decode_{concurrency}_ratio"] = round(rates["int8"] / rates["bf16"], 2)
            print(json.dumps(report), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64, help="per decode completion")
    parser.add_argument("--kv-cache-bytes", default="64MiB", help="both servers' KV budget")
    parser.add_argument("--flood", type=int, default=24, help="2k-token requests sent at once")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
