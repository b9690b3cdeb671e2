"""Round trips per request on the PostgreSQL + Redis path, counted (not timed).

Builds the app in process on the built-in model, PostgreSQL (its own database) and
Redis (a throwaway database number), sends a few warm-up requests, then counts what
`--requests` non-streamed chat completions of one token cost, per request:

- PostgreSQL: every message the driver sends that waits for an answer (libpq's trace:
  a simple Query, or an extended query's Sync; `;` is the pool's pre-ping), and the
  statements, commits and pool checkouts behind them (SQLAlchemy events);
- Redis: every command a client sends (MONITOR, this database number only; the commands
  a script runs inside the server are left out).

    python -m bench.round_trips [--requests 20] [--redis-db 14] [--stream]

Then it times how long a key generation change takes from its commit to a listener
(gateway.admission.key_generation). It asserts nothing; it prints the counts.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import sqlalchemy
from litestar.testing import AsyncTestClient
from redis.asyncio import Redis
from sqlalchemy import event

from backend.builtin import BUILTIN_MODEL_DIR
from gateway.admission.key_generation import GenerationListener
from gateway.app import create_app
from gateway.dispatch.engine_client import InProcessEngineClient
from gateway.runtime import Runtime
from gateway.settings import Settings
from tenants import db
from tenants.models import KeyRole
from tenants.services import ApiKeyService, TenantService, keys_changed

PG_SERVER = "postgresql+psycopg://postgres:postgres@127.0.0.1:5432/postgres"
PG_URL = "postgresql+psycopg://postgres:postgres@127.0.0.1:5432/tollgate_bench_round_trips"


def prepare_postgres() -> str:
    server = sqlalchemy.create_engine(PG_SERVER, isolation_level="AUTOCOMMIT")
    with server.connect() as connection:
        name = "tollgate_bench_round_trips"
        exists = connection.execute(
            sqlalchemy.text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name}
        ).first()
        if not exists:
            connection.execute(sqlalchemy.text(f"CREATE DATABASE {name}"))
    server.dispose()
    db.reset_schema(PG_URL)
    db.upgrade(PG_URL)
    return PG_URL


class Counts:
    def __init__(self) -> None:
        self.on = False
        self.sql: collections.Counter[str] = collections.Counter()

    def note(self, what: str) -> None:
        if self.on:
            self.sql[what] += 1


@contextmanager
def traced(runtime: Runtime, counts: Counts, trace_dir: Path) -> Iterator[list[Path]]:
    """libpq traces of every pooled connection, and SQLAlchemy's events, into `counts`."""
    files: list[Path] = []
    traced_connections: list[Any] = []

    def on_connect(dbapi_connection: Any, _record: object) -> None:
        path = trace_dir / f"conn{len(files)}.trace"
        files.append(path)
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        dbapi_connection.driver_connection.pgconn.trace(descriptor)
        traced_connections.append(dbapi_connection.driver_connection.pgconn)

    def on_execute(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        counts.note("statement " + statement.split()[0].upper())

    for engine, name in ((runtime.db.sync_engine, "db"), (runtime.direct.sync_engine, "direct")):
        event.listen(engine.pool, "connect", on_connect)
        event.listen(engine.pool, "checkout", lambda *_, n=name: counts.note(f"{n}: checkout"))
        event.listen(engine, "before_cursor_execute", on_execute)
        event.listen(engine, "commit", lambda *_, n=name: counts.note(f"{n}: commit"))
        event.listen(engine, "rollback", lambda *_, n=name: counts.note(f"{n}: rollback"))
        event.listen(engine.pool, "reset", lambda *_, n=name: counts.note(f"{n}: reset"))
    try:
        yield files
    finally:
        for pgconn in traced_connections:
            pgconn.untrace()  # flushes the trace


def wire_round_trips(files: list[Path]) -> collections.Counter[str]:
    """Frontend messages that wait for an answer."""
    seen: collections.Counter[str] = collections.Counter()
    for path in files:
        for line in path.read_text(errors="replace").splitlines():
            parts = line.split("\t")
            if len(parts) >= 4 and parts[1] == "F" and parts[3] in ("Query", "Sync"):
                text = parts[4] if parts[3] == "Query" and len(parts) > 4 else parts[3]
                seen[text.strip().strip('"')[:40]] += 1
    return seen


async def monitor(url: str, database: int, into: list[str], ready: asyncio.Event) -> None:
    client = Redis.from_url(url)
    async with client.monitor() as watch:
        ready.set()
        async for command in watch.listen():
            if command.get("db") == database and command.get("client_type") != "lua":
                into.append(str(command.get("command", "")).split(" ")[0].upper())


async def main(args: argparse.Namespace) -> None:
    redis_url = f"redis://127.0.0.1:6379/{args.redis_db}"
    base = Settings.from_env({})
    data = Path(tempfile.mkdtemp(prefix="tollgate-rt-"))
    settings = replace(base, database_url=prepare_postgres(), redis_url=redis_url, data_dir=data)
    scratch = Redis.from_url(redis_url)
    await scratch.flushdb()  # a throwaway database number, this script's alone
    await scratch.aclose()
    engine = await InProcessEngineClient.load(Path(BUILTIN_MODEL_DIR), settings.engine)
    app = create_app(settings, engine_client=engine)
    counts = Counts()
    commands: list[str] = []
    ready = asyncio.Event()
    watcher = asyncio.create_task(monitor(redis_url, args.redis_db, commands, ready))
    await ready.wait()
    try:
        async with AsyncTestClient(app=app) as client:
            runtime: Runtime = app.state.runtime
            async with runtime.sessions.begin() as session:
                tenant = await TenantService(session).create("rt")
                secret = (await ApiKeyService(session).create(tenant, "rt", KeyRole.TENANT)).secret
            headers = {"Authorization": f"Bearer {secret}"}
            body = {
                "model": "tollgate-tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 1,
                "stream": args.stream,
            }
            for _ in range(3):  # warm-up: the spend rebuild, the key's first lookup
                response = await client.post("/v1/chat/completions", json=body, headers=headers)
                assert response.status_code == 200, response.text
            await runtime.db.dispose()  # the connections made from here on are traced
            await runtime.direct.dispose()
            with traced(runtime, counts, data) as files:
                commands.clear()
                counts.on = True
                for _ in range(args.requests):
                    response = await client.post("/v1/chat/completions", json=body, headers=headers)
                    assert response.status_code == 200, response.text
                counts.on = False
            await asyncio.sleep(0.2)  # let MONITOR's last lines arrive (a count, not a test)
            wire = wire_round_trips(files)
    finally:
        watcher.cancel()
        await engine.close()
    n = args.requests
    kind = "streamed" if args.stream else "non-streamed"
    print(f"per request, over {n} {kind} chat completions of one token (the key remembered):")
    print(f"  PostgreSQL round trips: {sum(wire.values()) / n:.2f}")
    for what, count in wire.most_common():
        print(f"    {count / n:5.2f}  {what}")
    for what, count in sorted(counts.sql.items()):
        print(f"    {count / n:5.2f}  ({what})")
    redis = collections.Counter(commands)
    print(f"  Redis commands: {sum(redis.values()) / n:.2f}")
    for what, count in redis.most_common():
        print(f"    {count / n:5.2f}  {what}")
    delays = sorted(await notification_delays(settings.database_url, n))
    print(
        f"key generation change, commit returned -> listener has it, over {n} changes:"
        f" p50 {delays[n // 2]:.2f} ms, max {delays[-1]:.2f} ms"
    )


def _beyond(before: int, now: int | None) -> bool:
    return now is not None and now > before


async def notification_delays(url: str, changes: int) -> list[float]:
    """Milliseconds from each key generation bump's commit returning to a listener (in
    this process, its own connection) holding the new value."""
    listener = GenerationListener(db.libpq_url(url))
    engine = db.create_engine(url)
    sessions = db.session_factory(engine)
    listener.start()
    delays = []
    try:
        await listener.until(lambda generation: generation is not None)
        for _ in range(changes):
            before = listener.current()
            assert before is not None
            async with sessions.begin() as session:
                await keys_changed(session)
            committed = time.perf_counter()
            await listener.until(functools.partial(_beyond, before))
            delays.append((time.perf_counter() - committed) * 1000)
    finally:
        await listener.close()
        await engine.dispose()
    return delays


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--redis-db", type=int, default=14)
    parser.add_argument("--stream", action="store_true", help="streamed completions")
    asyncio.run(main(parser.parse_args()))
