"""One tenant's backlog against another tenant's fresh requests (issue 32 item 4). Measured
through the HTTP API of a real `tollgate serve` (embedded default, built-in model) that
this script starts on loopback: tenant C's streaming chat TTFT p50/p95 alone, then while
tenant B holds `--backlog` long streams open (on the CPU default of 32 running, the rest
waiting in the engine), all at the plan's default priority; and the ratio. Target: C's
p95 beside the backlog at most 2x alone. Each phase lasts past the 20 s after which B's
backlog, aged from its arrival, used to outrank C (4 classes at 5 s a class).

"Beside the backlog" counts C's chats sent once all of B's requests are in the engine
(running or waiting, from /metrics); those sent while B's requests still arrive (the
gateway admitting 200 requests at once, before the engine sees them) are reported apart,
as `during_arrival`, outside the target. `backlog_tokens_per_s`: B's streamed chunks (a
token each) per second over the same span, so a change that helps C can be seen not to
cost B.

    python -m bench.fair_share [--seconds 30] [--rate 1] [--backlog 200] [--repeat 2]
        [--fresh-tenants]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import re
import time
from typing import Any

import httpx

from bench._common import percentile
from bench.hostile_load import open_loop, ttft
from bench.serve import phase_options, serving


async def hold_stream(
    http: httpx.AsyncClient, base: str, key: str, model: str, chunks: list[float]
) -> None:
    """One of B's long streams, read until it ends or is cancelled; the time of each of
    its chunks (one a token) goes to `chunks`."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Tell me a very long story."}],
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {key}"}
    async with http.stream("POST", f"{base}/v1/chat/completions", json=body, headers=headers) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunks.append(time.monotonic())


ENGINE_LOAD = re.compile(
    r"^tollgate_engine_requests_(?:running|waiting)(?:\{[^}]*\})? ([0-9.e+-]+)$", re.M
)


async def backlog_in_engine(http: httpx.AsyncClient, base: str, backlog: int) -> float:
    """When the engine first holds `backlog` requests, running or waiting."""
    while True:
        text = (await http.get(f"{base}/metrics")).text
        if sum(float(m) for m in ENGINE_LOAD.findall(text)) >= backlog:
            return time.monotonic()
        await asyncio.sleep(0.05)


def timed(send: Any) -> Any:
    async def wrapped() -> tuple[float, float | None]:
        return time.monotonic(), await send()

    return wrapped


async def measure(
    http: httpx.AsyncClient, base: str, keys_bc: tuple[str, str], model: str, args: Any, run: int
) -> dict[str, Any]:
    backlog_key, chat_key = keys_bc

    def chat() -> Any:
        return ttft(http, base, chat_key, model)

    alone = [t for t in await open_loop(args.rate, args.seconds, chat) if t is not None]
    chunks: list[float] = []
    streams = [
        asyncio.ensure_future(hold_stream(http, base, backlog_key, model, chunks))
        for _ in range(args.backlog)
    ]
    started = time.monotonic()
    settled = asyncio.ensure_future(backlog_in_engine(http, base, args.backlog))
    sent = await open_loop(args.rate, args.seconds, timed(chat))
    ended = time.monotonic()
    held_s = ended - started
    settled_at = await settled if settled.done() else math.inf
    settled.cancel()
    if not any(at >= settled_at for at, _ in sent):
        raise SystemExit(f"B's {args.backlog} requests were never all in the engine")
    beside = [t for at, t in sent if t is not None and at >= settled_at]
    arriving = [t for at, t in sent if t is not None and at < settled_at]
    still_open = sum(not s.done() for s in streams)
    for stream in streams:  # closing them cancels them in the engine
        stream.cancel()
    for stream in streams:
        with contextlib.suppress(BaseException):
            await stream
    a95, b95 = percentile(alone, 95), percentile(beside, 95)
    return {
        "run": run,
        "chat_ttft_alone_ms": {
            "p50": round(percentile(alone, 50) * 1e3, 1),
            "p95": round(a95 * 1e3, 1),
        },
        "chat_ttft_beside_backlog_ms": {
            "p50": round(percentile(beside, 50) * 1e3, 1),
            "p95": round(b95 * 1e3, 1),
            "max": round(max(beside) * 1e3, 1),
        },
        "p95_ratio": round(b95 / a95, 2),
        "target_met": b95 <= 2 * a95,
        "chat_requests": [len(alone), len(beside)],
        "during_arrival": {
            "backlog_in_engine_after_s": round(settled_at - started, 2),
            "chat_ttft_ms": [round(t * 1e3, 1) for t in arriving],
        },
        "backlog_streams_open_at_the_end": still_open,
        # B's throughput once all its requests were in: its streams' chunks per second
        "backlog_tokens_per_s": round(
            sum(at >= settled_at for at in chunks) / max(ended - settled_at, 1e-9), 1
        ),
        "backlog_held_s": round(held_s, 1),
    }


async def run(args: argparse.Namespace) -> None:
    limits = httpx.Limits(max_connections=args.backlog + 100)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http, serving(http) as server:
        backlog_key = await server.tenant_key()
        for attempt in range(args.repeat):
            keys_bc = (backlog_key, server.key)
            if args.fresh_tenants:  # each run's B and C new to the engine
                keys_bc = (await server.tenant_key(), await server.tenant_key())
            report = await measure(http, server.base, keys_bc, server.model, args, attempt + 1)
            print(json.dumps(report), flush=True)


def main() -> None:
    parser = phase_options(__doc__, seconds=30.0, rate=1.0, rate_help="C's chats per second")
    parser.add_argument("--backlog", type=int, default=200, help="B's open streams")
    parser.add_argument(
        "--fresh-tenants", action="store_true", help="a new B and C for each run of --repeat"
    )
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
