"""How long rebuilding every tenant's and key's spend from a 1M-row ledger takes: the
time a Redis restart holds admission for (plus the lease_s / 2 hold), and the cost of the
periodic whole-period reconcile.

Fills its own PostgreSQL database (default `tollgate_bench_quota`, rebuilt by the
migrations) with `--rows` ledger rows of this month in one INSERT … SELECT over
`--tenants` tenants (one key each); `--recent` of them fall inside the rebuild's grace
window, so they are charged one by one as after a restart. Then times
gateway.admission.reconcile.rebuild on an empty store (a restart) and again on the
filled one (the periodic run), on Redis under a throwaway key prefix (deleted after):

    .venv/bin/python -m bench.quota_rebuild [--rows 1000000] [--tenants 1000] [--reuse]
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from datetime import datetime, timedelta

from sqlalchemy import create_engine, func, select, text
from sqlalchemy.engine import Connection

from bench.usage_report import _tenants, ensure_database
from gateway.admission.reconcile import GRACE_S, period_bounds, rebuild
from tenants import db
from tenants.models import UsageEvent, utcnow
from tenants.quota import RedisQuotaStore, month_period, tenant_scope


def fill(url: str, rows: int, tenants: int, recent: int) -> None:
    db.reset_schema(url)
    db.upgrade(url)
    start, _ = period_bounds(month_period())
    now = utcnow()
    engine = create_engine(db.sync_url(url), isolation_level="AUTOCOMMIT")
    with engine.connect() as connection:
        began = time.perf_counter()
        _tenants(connection, tenants)
        _rows(connection, rows - recent, tenants, start, now.replace(microsecond=0), 0)
        # The newest rows: inside the grace window, charged one by one by the rebuild.
        window_start = now - timedelta(seconds=GRACE_S / 2)
        _rows(connection, recent, tenants, window_start, now, rows - recent)
        connection.execute(text("VACUUM ANALYZE usage_events"))
        print(f"filled {rows:,} rows ({recent:,} recent) in {time.perf_counter() - began:.1f} s")
    engine.dispose()


def _rows(
    connection: Connection, rows: int, tenants: int, since: datetime, until: datetime, offset: int
) -> None:
    connection.execute(
        text(
            """
            INSERT INTO usage_events (
                id, request_id, tenant_id, api_key_id, model, endpoint, status,
                prompt_tokens, cached_tokens, completion_tokens, cost_micros, created_at)
            SELECT gen_random_uuid()::text, 'req_' || (g + :offset), 'tenant-' || g % :tenants,
                   'key-' || g % :tenants, 'tiny', 'chat.completions', 'completed',
                   100 + g % 1900, 0, 10 + g % 490, 1 + g % 5000,
                   :since + (g::float / :rows) * (:until - :since)
            FROM generate_series(1, :rows) AS g
            """
        ),
        {"rows": rows, "tenants": tenants, "since": since, "until": until, "offset": offset},
    )


async def measure(url: str, redis_url: str) -> None:
    engine = db.create_engine(url)
    sessions = db.session_factory(engine)
    prefix = f"tgbench:quota:{uuid.uuid4().hex}:"
    store = RedisQuotaStore.from_url(redis_url, prefix=prefix, guarded=True)
    try:
        async with sessions() as session:
            total = await session.scalar(select(func.sum(UsageEvent.cost_micros)))
        for label in ("empty store (after a restart)", "filled store (periodic run)"):
            began = time.perf_counter()
            rebuilt = await rebuild(sessions, store)
            took = time.perf_counter() - began
            print(
                f"rebuild, {label}: {took:.2f} s — {rebuilt.scopes:,} scopes, "
                f"{rebuilt.charged:,} recent rows charged one by one, ready={rebuilt.ready}"
            )
        spent = 0
        async with sessions() as session:
            tenant_ids = (await session.scalars(text("SELECT id FROM tenants"))).all()
        for tenant_id in tenant_ids:
            spent += (await store.usage(tenant_scope(tenant_id), month_period())).spent_micros
        print(
            f"store spent, all tenants: {spent:,}; ledger: {int(total or 0):,}; "
            f"equal: {spent == total}"
        )
    finally:
        client = store._client
        keys = [key async for key in client.scan_iter(match=f"{prefix}*", count=1000)]
        for index in range(0, len(keys), 1000):
            await client.delete(*keys[index : index + 1000])
        await store.aclose()
        await engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--tenants", type=int, default=1000)
    parser.add_argument("--recent", type=int, default=3000, help="rows in the grace window")
    parser.add_argument("--database", default="tollgate_bench_quota")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--reuse", action="store_true", help="keep the rows already there")
    args = parser.parse_args()
    url = ensure_database(args.database)
    if not args.reuse:
        fill(url, args.rows, args.tenants, args.recent)
    asyncio.run(measure(url, args.redis))


if __name__ == "__main__":
    main()
