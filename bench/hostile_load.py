"""Hostile load: one tenant sends 10x its request quota while another chats. Measured
through the HTTP API of a real `tollgate serve` (embedded default, built-in model) that
this script starts on loopback: the chat tenant's streaming TTFT p50/p95 alone, then
beside the flood, and the ratio (issue 13's target: p95 at most 2x alone).

    python -m bench.hostile_load [--seconds 20] [--rate 2] [--repeat 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from typing import Any

import httpx

from bench._common import percentile
from bench.serve import phase_options, serving

QUOTA_RPM = 60  # the hostile tenant's plan: one request a second
CHAT = [{"role": "user", "content": "Write a haiku about the sea."}]


async def ttft(http: httpx.AsyncClient, base: str, key: str, model: str) -> float | None:
    body = {"model": model, "messages": CHAT, "max_tokens": 16, "stream": True}
    started = time.monotonic()
    headers = {"Authorization": f"Bearer {key}"}
    async with http.stream("POST", f"{base}/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            return None
        first = None
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.monotonic() - started
        return first


async def open_loop(rate: float, seconds: float, send: Any) -> list[Any]:
    """Poisson arrivals at `rate` per second for `seconds`; returns every result."""
    rng, tasks = random.Random(7), []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        tasks.append(asyncio.ensure_future(send()))
        await asyncio.sleep(rng.expovariate(rate))
    return list(await asyncio.gather(*tasks))


async def hostile(http: httpx.AsyncClient, base: str, key: str, model: str) -> int:
    """A long prompt (two thirds of the built-in model's context), as a flood would send."""
    body = {"model": model, "prompt": "lorem ipsum dolor " * 150, "max_tokens": 64}  # 1,352 tokens
    headers = {"Authorization": f"Bearer {key}"}
    return (await http.post(f"{base}/v1/completions", json=body, headers=headers)).status_code


async def run(args: argparse.Namespace) -> None:
    limits = httpx.Limits(max_connections=1000)
    async with httpx.AsyncClient(timeout=300, limits=limits) as http, serving(http) as server:
        plan = {"name": "capped", "rpm": QUOTA_RPM}
        reply = await http.post(
            f"{server.base}/admin/api/plans", json=plan, headers=server.admin_headers
        )
        reply.raise_for_status()
        flood_key = await server.tenant_key("capped")
        for attempt in range(args.repeat):
            await measure(http, server.base, server.key, flood_key, server.model, args, attempt)


async def measure(
    http: httpx.AsyncClient,
    base: str,
    chat_key: str,
    flood_key: str,
    model: str,
    args: argparse.Namespace,
    attempt: int,
) -> None:
    def chat() -> Any:
        return ttft(http, base, chat_key, model)

    alone = [t for t in await open_loop(args.rate, args.seconds, chat) if t is not None]
    flood_rate = 10 * QUOTA_RPM / 60

    def flood() -> Any:
        return hostile(http, base, flood_key, model)

    flooding = asyncio.ensure_future(open_loop(flood_rate, args.seconds, flood))
    beside = [t for t in await open_loop(args.rate, args.seconds, chat) if t is not None]
    statuses = await flooding
    a95, b95 = percentile(alone, 95), percentile(beside, 95)
    report = {
        "run": attempt + 1,
        "chat_ttft_alone_ms": {"p50": percentile(alone, 50) * 1e3, "p95": a95 * 1e3},
        "chat_ttft_beside_flood_ms": {"p50": percentile(beside, 50) * 1e3, "p95": b95 * 1e3},
        "p95_ratio": b95 / a95,
        "flood_sent": len(statuses),
        "flood_admitted": statuses.count(200),
        "flood_429": statuses.count(429),
        "chat_requests": [len(alone), len(beside)],
    }
    print(json.dumps(report, indent=None))


def main() -> None:
    parser = phase_options(__doc__, seconds=20.0, rate=2.0, rate_help="chat requests per second")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
