"""Batch work in the gaps of interactive traffic (issue 36). Measured through the HTTP API
of a real `tollgate serve` (embedded default, built-in model) that this script starts on
loopback: two tenants send streaming chat at a steady rate in bursts with idle gaps,
first alone, then with a third tenant's batch of `--lines` requests submitted through
/v1/files and /v1/batches as the phase starts. Reported both ways: interactive TTFT p90
and inter-token latency p95 (target: beside the batch at most 1.3x alone); the batch's
completion time; and the engine's busy share (its cumulative step time, from /metrics,
over the wall clock), with the share of the idle step capacity the batch filled:
(busy beside - busy alone) / (1 - busy alone) over the phase (target: at least 0.8).

    python -m bench.batch_fill [--seconds 40] [--rate 2] [--burst 3] [--gap 3] [--lines 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import re
import time
from typing import Any

import httpx

from bench._common import percentile
from bench.serve import phase_options, serving

CHAT = [{"role": "user", "content": "Write a haiku about the sea."}]
BUSY = re.compile(r"^tollgate_engine_busy_seconds(?:\{[^}]*\})? ([0-9.e+-]+)$", re.M)


async def busy_s(http: httpx.AsyncClient, base: str) -> float:
    match = BUSY.search((await http.get(f"{base}/metrics")).text)
    assert match is not None, "the gateway exports no tollgate_engine_busy_seconds"
    return float(match[1])


async def chat(
    http: httpx.AsyncClient, base: str, key: str, model: str, max_tokens: int
) -> tuple[float, list[float]] | None:
    """One streamed chat: its TTFT and the gaps between its tokens, in seconds."""
    body = {"model": model, "messages": CHAT, "max_tokens": max_tokens, "stream": True}
    headers = {"Authorization": f"Bearer {key}"}
    started = time.monotonic()
    arrivals: list[float] = []
    async with http.stream("POST", f"{base}/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            return None
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"content"' in line:
                arrivals.append(time.monotonic())
    if not arrivals:
        return None
    return arrivals[0] - started, [b - a for a, b in itertools.pairwise(arrivals)]


async def interactive(
    http: httpx.AsyncClient, base: str, keys_ab: list[str], model: str, args: Any
) -> list[tuple[float, list[float]]]:
    """Each tenant at `rate` per second (evenly spaced) for `burst` s, then idle `gap` s."""
    tasks: list[asyncio.Future[Any]] = []
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        burst_end = time.monotonic() + args.burst
        while time.monotonic() < burst_end:
            for key in keys_ab:
                tasks.append(asyncio.ensure_future(chat(http, base, key, model, args.max_tokens)))
            await asyncio.sleep(1 / args.rate)
        await asyncio.sleep(args.gap)
    return [r for r in await asyncio.gather(*tasks) if r is not None]


def batch_file(model: str, lines: int, max_tokens: int) -> bytes:
    rows = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": model,
                "messages": [{"role": "user", "content": f"Summarise item {i} in one line."}],
                "max_tokens": max_tokens,
            },
        }
        for i in range(lines)
    ]
    return b"".join(json.dumps(row).encode() + b"\n" for row in rows)


async def submit(http: httpx.AsyncClient, base: str, key: str, content: bytes) -> str:
    headers = {"Authorization": f"Bearer {key}"}
    files = {"file": ("batch.jsonl", content, "application/jsonl")}
    uploaded = await http.post(
        f"{base}/v1/files", data={"purpose": "batch"}, files=files, headers=headers
    )
    uploaded.raise_for_status()
    body = {
        "input_file_id": uploaded.json()["id"],
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
    }
    created = await http.post(f"{base}/v1/batches", json=body, headers=headers)
    created.raise_for_status()
    return str(created.json()["id"])


async def finished(
    http: httpx.AsyncClient, base: str, key: str, batch_id: str
) -> tuple[dict[str, Any], float, float]:
    """The batch once final, when it was seen final, and the engine's busy seconds then."""
    headers = {"Authorization": f"Bearer {key}"}
    while True:
        batch: dict[str, Any] = (
            await http.get(f"{base}/v1/batches/{batch_id}", headers=headers)
        ).json()
        if batch["status"] in ("completed", "failed", "expired", "cancelled"):
            return batch, time.monotonic(), await busy_s(http, base)
        await asyncio.sleep(0.25)


def latencies(results: list[tuple[float, list[float]]]) -> dict[str, float]:
    ttfts = [t for t, _ in results]
    gaps = [g for _, gs in results for g in gs]
    return {
        "ttft_p90_ms": round(percentile(ttfts, 90) * 1000, 1),
        "itl_p95_ms": round(percentile(gaps, 95) * 1000, 1),
        "requests": len(results),
    }


async def phase(
    http: httpx.AsyncClient, base: str, keys_ab: list[str], model: str, args: Any
) -> tuple[dict[str, float], float, float]:
    """Interactive traffic for one phase: its latencies, and when it ended with the
    engine's busy seconds then."""
    results = await interactive(http, base, keys_ab, model, args)
    return latencies(results), time.monotonic(), await busy_s(http, base)


async def run(args: argparse.Namespace) -> None:
    limits = httpx.Limits(max_connections=1000)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http, serving(http) as server:
        for attempt in range(args.repeat):
            keys_ab = [await server.tenant_key() for _ in range(2)]
            batch_key = await server.tenant_key()
            await measure(http, server.base, keys_ab, batch_key, server.model, args, attempt)


async def measure(
    http: httpx.AsyncClient,
    base: str,
    keys_ab: list[str],
    batch_key: str,
    model: str,
    args: Any,
    run: int,
) -> None:
    start, busy0 = time.monotonic(), await busy_s(http, base)
    alone, end, busy1 = await phase(http, base, keys_ab, model, args)
    busy_alone = (busy1 - busy0) / (end - start)
    content = batch_file(model, args.lines, args.batch_max_tokens)
    submitted, busy0 = time.monotonic(), await busy_s(http, base)
    batch_id = await submit(http, base, batch_key, content)
    done = asyncio.ensure_future(finished(http, base, batch_key, batch_id))
    beside, end, busy1 = await phase(http, base, keys_ab, model, args)
    batch, done_at, busy_done = await done
    completion_s = done_at - submitted
    # Over the phase, or until the batch finished if sooner: the capacity it could fill.
    if done_at < end:
        end, busy1 = done_at, busy_done
    busy_beside = (busy1 - busy0) / (end - submitted)
    idle = 1 - busy_alone
    report = {
        "run": run + 1,
        "alone": alone,
        "beside_batch": beside,
        "ttft_p90_ratio": round(beside["ttft_p90_ms"] / alone["ttft_p90_ms"], 2),
        "itl_p95_ratio": round(beside["itl_p95_ms"] / alone["itl_p95_ms"], 2),
        "batch": {
            "lines": args.lines,
            "status": batch["status"],
            "counts": batch["request_counts"],
            "completion_s": round(completion_s, 1),
            "finished_within_phase": done_at <= end,
        },
        "engine_busy_share": {"alone": round(busy_alone, 3), "beside_batch": round(busy_beside, 3)},
        "idle_capacity_filled": round((busy_beside - busy_alone) / idle, 3) if idle > 0 else None,
    }
    print(json.dumps(report, indent=None), flush=True)


def main() -> None:
    parser = phase_options(
        __doc__, seconds=40.0, rate=2.0, rate_help="chats per second per tenant", repeat=1
    )
    parser.add_argument("--burst", type=float, default=3.0, help="seconds of traffic")
    parser.add_argument("--gap", type=float, default=3.0, help="idle seconds between bursts")
    parser.add_argument("--max-tokens", type=int, default=32, help="per interactive chat")
    parser.add_argument("--lines", type=int, default=2000, help="requests in the batch")
    parser.add_argument("--batch-max-tokens", type=int, default=32)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
