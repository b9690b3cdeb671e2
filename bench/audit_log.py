"""Audit log cost: one hash-chained append per transaction, and verification speed.

Baseline in the same run: the same row inserted into a plain table with no chain (no
lock, no head read, no hash), also one per transaction. Then `--concurrency` tasks
appending at once (the lock serializes them), and `verify` over everything appended:

    .venv/bin/python -m bench.audit_log [--events 2000] [--concurrency 16]
        [--postgres postgresql://postgres:postgres@127.0.0.1:5432/SCRATCH_DB]

The PostgreSQL database given is wiped (its public schema is recreated): use a scratch one.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from sqlalchemy import create_engine, text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from tenants import audit, db

DETAILS = {"changes": {"rpm": [60, 120], "tpm": [None, 100_000]}}
PLAIN_TABLE = """CREATE TABLE bench_plain (
    id BIGINT PRIMARY KEY, occurred_at TIMESTAMP, actor VARCHAR(320), action VARCHAR(64),
    target VARCHAR(320), details TEXT, hash VARCHAR(64))"""


def _fresh(url: str) -> None:
    if db.sync_url(url).get_backend_name() == "postgresql":
        db.reset_schema(url)
    db.upgrade(url)
    engine = create_engine(db.sync_url(url))
    with engine.begin() as connection:
        connection.execute(text(PLAIN_TABLE))
    engine.dispose()


async def _plain(sessions: async_sessionmaker[AsyncSession], count: int) -> float:
    started = time.perf_counter()
    for number in range(count):
        async with sessions.begin() as session:
            await session.execute(
                text(
                    "INSERT INTO bench_plain VALUES "
                    "(:id, CURRENT_TIMESTAMP, 'cli:bench', 'plan.update', 'plan:p', :d, :h)"
                ),
                {"id": number, "d": str(DETAILS), "h": "0" * 64},
            )
    return time.perf_counter() - started


async def _append(sessions: async_sessionmaker[AsyncSession], number: int) -> None:
    async with sessions.begin() as session:
        await audit.record(
            session,
            actor="cli:bench",
            action="plan.update",
            target=f"plan:p{number}",
            details=DETAILS,
        )


async def _chained(sessions: async_sessionmaker[AsyncSession], count: int) -> float:
    started = time.perf_counter()
    for number in range(count):
        await _append(sessions, number)
    return time.perf_counter() - started


async def _concurrent(
    sessions: async_sessionmaker[AsyncSession], count: int, concurrency: int
) -> float:
    queue = iter(range(count))

    async def worker() -> None:
        for number in queue:
            await _append(sessions, number)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - started


async def _verify(sessions: async_sessionmaker[AsyncSession]) -> tuple[float, int]:
    started = time.perf_counter()
    async with sessions() as session:
        result = await audit.verify(session)
    assert result.ok, result.describe()
    return time.perf_counter() - started, result.events


async def bench(url: str, label: str, events: int, concurrency: int) -> None:
    _fresh(url)
    engine = db.create_engine(url)
    sessions = db.session_factory(engine)
    try:
        plain = await _plain(sessions, events)
        chained = await _chained(sessions, events)
        together = await _concurrent(sessions, events, concurrency)
        verify_s, verified = await _verify(sessions)
    finally:
        await engine.dispose()
    us = 1e6 / events
    print(f"{label}: {events} events, one per transaction")
    print(f"  plain insert (baseline)   {plain * us:8.0f} us/event")
    print(f"  chained append            {chained * us:8.0f} us/event  ({chained / plain:.2f}x)")
    print(
        f"  chained, {concurrency:2d} concurrent    {together * us:8.0f} us/event (wall / events)"
    )
    print(f"  verify                    {verified / verify_s:8.0f} events/s ({verified} events)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--postgres", help="a scratch PostgreSQL database (wiped)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        sqlite = f"sqlite:///{Path(folder) / 'audit.db'}"
        asyncio.run(bench(sqlite, "SQLite (WAL)", args.events, args.concurrency))
    if args.postgres:
        asyncio.run(bench(args.postgres, "PostgreSQL", args.events, args.concurrency))


if __name__ == "__main__":
    main()
