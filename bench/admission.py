"""Admission cost per request: reserve + settle on the quota store.

Runs the same workload against the in-process store (the same-run baseline) and the
Redis store on loopback, and prints microseconds per request and the ratio:

    .venv/bin/python bench/admission.py [--requests 5000] [--scopes 2] [--concurrency 32]

Sequential: one reserve then one settle at a time (the latency a request pays).
Concurrent: `--concurrency` tasks in one event loop doing the same (what one gateway
process sustains; per-request figure = wall time / requests). A Redis PING loop is
printed too: the floor of one round trip through redis-py's asyncio client.
Every request is granted (limits are set high), so the figures are of the full path:
checks, charges in every scope, and the settle's release and charge.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable

from redis.asyncio import Redis

from tenants.quota import (
    Granted,
    Limits,
    MemoryQuotaStore,
    QuotaStore,
    RedisQuotaStore,
    ReserveRequest,
    Scope,
)

PERIOD = "2026-11"


def scopes_for(count: int) -> tuple[Scope, ...]:
    """A tenant with every limit set, then per-key scopes with overrides."""
    limits = Limits(rpm=10**9, tpm=10**12, max_concurrent=10**6, budget_micros=10**15)
    tenant = Scope("tenant:bench", limits)
    keys = tuple(Scope(f"key:bench{i}", limits) for i in range(count - 1))
    return (*keys, tenant)


async def one_request(store: QuotaStore, rid: str, scopes: tuple[Scope, ...]) -> None:
    outcome = await store.reserve(ReserveRequest(rid, scopes, 1500, 2500, PERIOD, 60.0))
    if not isinstance(outcome, Granted):
        raise RuntimeError(f"benchmark request denied: {outcome}")
    await store.settle(outcome.reservation, 900, 1700)


async def sequential(
    store: QuotaStore, scopes: tuple[Scope, ...], requests: int, tag: str
) -> tuple[list[float], float]:
    """Wall microseconds of each reserve + settle, one request at a time, and this
    process's CPU microseconds per request (less sensitive to a busy machine)."""
    samples = []
    cpu_started = time.process_time_ns()
    for i in range(requests):
        started = time.perf_counter_ns()
        await one_request(store, f"{tag}-{i}", scopes)
        samples.append((time.perf_counter_ns() - started) / 1000)
    return samples, (time.process_time_ns() - cpu_started) / 1000 / requests


async def concurrent(
    store: QuotaStore, scopes: tuple[Scope, ...], requests: int, tasks: int, tag: str
) -> float:
    """Wall microseconds per request with `tasks` requests in flight."""
    per_task = max(1, requests // tasks)

    async def worker(w: int) -> None:
        for i in range(per_task):
            await one_request(store, f"{tag}-{w}-{i}", scopes)

    started = time.perf_counter_ns()
    await asyncio.gather(*(worker(w) for w in range(tasks)))
    return (time.perf_counter_ns() - started) / 1000 / (per_task * tasks)


async def evalsha_stats(client: Redis) -> tuple[int, int]:
    """(calls, microseconds) of EVALSHA since the server started: the scripts' own time."""
    stats = (await client.info("commandstats")).get("cmdstat_evalsha", {})
    return int(stats.get("calls", 0)), int(stats.get("usec", 0))


async def ping_us(client: Redis, rounds: int) -> float:
    started = time.perf_counter_ns()
    for _ in range(rounds):
        await client.ping()
    return (time.perf_counter_ns() - started) / 1000 / rounds


def summary(samples: list[float]) -> str:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return (
        f"mean {statistics.fmean(samples):8.1f} us   p50 {statistics.median(samples):8.1f} us"
        f"   p99 {p99:8.1f} us"
    )


async def measure(
    name: str,
    make: Callable[[], QuotaStore],
    scopes: tuple[Scope, ...],
    requests: int,
    tasks: int,
    before_close: Callable[[], Awaitable[None]] | None = None,
) -> tuple[float, float]:
    store = make()
    try:
        await sequential(store, scopes, min(500, requests), f"{name}-warm")
        samples, cpu_us = await sequential(store, scopes, requests, f"{name}-seq")
        per_request = await concurrent(store, scopes, requests, tasks, f"{name}-conc")
    finally:
        if before_close is not None:
            await before_close()
        await store.aclose()
    print(f"{name:>6} sequential  {summary(samples)}   client CPU {cpu_us:6.1f} us")
    print(f"{name:>6} concurrent  {per_request:8.1f} us/request with {tasks} in flight")
    return statistics.median(samples), per_request


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--scopes", type=int, default=2, help="scopes per reservation")
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    scopes = scopes_for(args.scopes)
    load = os.getloadavg()[0]
    print(
        f"admission = reserve + settle, {args.scopes} scope(s) per reservation, "
        f"{args.requests} requests per run; {os.cpu_count()} CPUs, load average {load:.1f}"
    )

    memory_p50, memory_conc = await measure(
        "memory", MemoryQuotaStore, scopes, args.requests, args.concurrency
    )

    prefix = f"bench:quota:{uuid.uuid4().hex}:"
    client = Redis.from_url(args.redis_url)

    async def cleanup() -> None:
        keys = [key async for key in client.scan_iter(match=f"{prefix}*", count=1000)]
        for start in range(0, len(keys), 1000):
            await client.delete(*keys[start : start + 1000])

    try:
        print(f"{'redis':>6} PING        {await ping_us(client, 2000):8.1f} us (one round trip)")
        calls_before, usec_before = await evalsha_stats(client)
        redis_p50, redis_conc = await measure(
            "redis",
            lambda: RedisQuotaStore(client, prefix=prefix),
            scopes,
            args.requests,
            args.concurrency,
            before_close=cleanup,
        )
        calls_after, usec_after = await evalsha_stats(client)
        if calls_after > calls_before:
            per_call = (usec_after - usec_before) / (calls_after - calls_before)
            print(
                f"{'redis':>6} server time {per_call:8.1f} us per script call "
                "(INFO commandstats; includes any other client's EVALSHA meanwhile)"
            )
    finally:
        await client.aclose()
    print(
        f"ratio redis/memory: sequential p50 {redis_p50 / memory_p50:.1f}x, "
        f"concurrent {redis_conc / memory_conc:.1f}x"
    )


if __name__ == "__main__":
    asyncio.run(main())
