"""A tenant's month report and the /v1/usage queries on a 10-million-row ledger.

Fills its own PostgreSQL database (default `tollgate_bench_usage`, dropped and rebuilt by
the migrations) with `--rows` ledger rows in one INSERT … SELECT generate_series, spread
over 90 days and `--tenants` tenants (the first one is 10x larger than the others), then
times the real report code (tenants.billing.reports.build_report, which /v1/usage and the
admin report run) and the per-request lookup, printing EXPLAIN ANALYZE and, as the same
run's baseline, the report with index scans turned off:

    .venv/bin/python bench/usage_report.py [--rows 10000000] [--tenants 100] [--reuse]

`--reuse` skips the fill when the database already holds the rows. The report indexes
are built after the fill, as a bulk load would do.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from datetime import UTC, datetime

from sqlalchemy import create_engine, text
from sqlalchemy.engine import Connection, make_url

from tenants import db
from tenants.billing.reports import Period, build_report
from tenants.models import Tenant

ADMIN_URL = "postgresql+psycopg://postgres:postgres@127.0.0.1:5432/postgres"
END = datetime(2026, 11, 30, tzinfo=UTC)  # rows span the 90 days before this
MONTH = Period.parse("2026-10")  # a whole month inside the span
REPORT_INDEXES = ("ix_usage_events_tenant_created", "ix_usage_events_created_at")


def ensure_database(name: str) -> str:
    admin = create_engine(ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        exists = connection.scalar(
            text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name}
        )
        if not exists:
            connection.execute(text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    return make_url(ADMIN_URL).set(database=name).render_as_string(hide_password=False)


def fill(url: str, rows: int, tenants: int) -> None:
    db.reset_schema(url)
    db.upgrade(url)
    engine = create_engine(db.sync_url(url), isolation_level="AUTOCOMMIT")
    with engine.connect() as connection:
        started = time.perf_counter()
        _tenants(connection, tenants)
        for index in REPORT_INDEXES:
            connection.execute(text(f"DROP INDEX {index}"))
        # Tenant 0 takes ~10% of the rows; the rest share the remainder evenly.
        connection.execute(
            text(
                """
                INSERT INTO usage_events (
                    id, request_id, tenant_id, api_key_id, model, endpoint, status,
                    finish_reason, prompt_tokens, cached_tokens, completion_tokens,
                    cost_micros, queue_ms, ttft_ms, e2e_ms, itl_ms, priority, created_at)
                SELECT gen_random_uuid()::text, 'req_' || g, 'tenant-' || t, 'key-' || t,
                       CASE WHEN g % 3 = 0 THEN 'small' ELSE 'tiny' END, 'chat.completions',
                       CASE WHEN g % 50 = 0 THEN 'cancelled' ELSE 'completed' END, 'stop',
                       p, p / 4, c, (p * 100000 + c * 400000) / 1000000 + 1,
                       5, 40, 900, 12, 4,
                       :end - (g::float / :rows) * interval '90 days'
                FROM (
                    SELECT g,
                           CASE WHEN g % 10 = 0 THEN 0 ELSE 1 + g % (:tenants - 1) END AS t,
                           100 + g % 1900 AS p, 10 + g % 490 AS c
                    FROM generate_series(1, :rows) AS g
                ) AS s
                """
            ),
            {"rows": rows, "tenants": tenants, "end": END},
        )
        loaded = time.perf_counter()
        connection.execute(
            text(
                "CREATE INDEX ix_usage_events_tenant_created ON usage_events "
                "(tenant_id, created_at) INCLUDE "
                "(model, status, prompt_tokens, cached_tokens, completion_tokens, cost_micros)"
            )
        )
        connection.execute(
            text("CREATE INDEX ix_usage_events_created_at ON usage_events (created_at)")
        )
        indexed = time.perf_counter()
        connection.execute(text("VACUUM ANALYZE usage_events"))
        print(
            f"filled {rows:,} rows in {loaded - started:.1f} s, "
            f"indexes {indexed - loaded:.1f} s, vacuum {time.perf_counter() - indexed:.1f} s"
        )
    engine.dispose()


def _tenants(connection: Connection, tenants: int) -> None:
    connection.execute(
        text(
            "INSERT INTO tenants (id, name, created_at) "
            "SELECT 'tenant-' || t, 'tenant-' || t, now() FROM generate_series(0, :n - 1) t"
        ),
        {"n": tenants},
    )
    connection.execute(
        text(
            "INSERT INTO api_keys (id, tenant_id, prefix, key_hash, created_at) "
            "SELECT 'key-' || t, 'tenant-' || t, 'tg-' || lpad(t::text, 8, '0'), '', now() "
            "FROM generate_series(0, :n - 1) t"
        ),
        {"n": tenants},
    )


async def time_report(url: str, tenant_id: str, repeats: int) -> tuple[float, int]:
    engine = db.create_engine(url)
    try:
        sessions = db.session_factory(engine)
        timings = []
        requests = 0
        for _ in range(repeats):
            async with sessions() as session:
                tenant = await session.get_one(Tenant, tenant_id)
                started = time.perf_counter()
                report = await build_report(session, tenant, MONTH)
                timings.append(time.perf_counter() - started)
                requests = report.totals.requests
        return statistics.median(timings) * 1000, requests
    finally:
        await engine.dispose()


REPORT_SQL = """
SELECT (created_at AT TIME ZONE 'UTC')::date AS day, model, status, count(*),
       sum(prompt_tokens), sum(cached_tokens), sum(completion_tokens), sum(cost_micros)
FROM usage_events
WHERE tenant_id = :tenant AND created_at >= :start AND created_at < :end
GROUP BY 1, 2, 3
"""


def explain(url: str, tenant_id: str, indexes: bool) -> tuple[list[str], float]:
    engine = create_engine(db.sync_url(url))
    with engine.connect() as connection:
        if not indexes:
            for knob in ("enable_indexscan", "enable_indexonlyscan", "enable_bitmapscan"):
                connection.execute(text(f"SET {knob} = off"))
        params = {"tenant": tenant_id, "start": MONTH.start, "end": MONTH.end}
        connection.execute(text(REPORT_SQL), params).all()  # warm the cache
        started = time.perf_counter()
        connection.execute(text(REPORT_SQL), params).all()
        elapsed = (time.perf_counter() - started) * 1000
        plan = connection.execute(text("EXPLAIN (ANALYZE, BUFFERS) " + REPORT_SQL), params)
        lines = [row[0] for row in plan]
    engine.dispose()
    return lines, elapsed


def time_lookup(url: str, repeats: int = 200) -> float:
    """GET /v1/usage/requests/{id}: one row by request id and tenant."""
    engine = create_engine(db.sync_url(url))
    with engine.connect() as connection:
        timings = []
        for g in range(1, repeats + 1):
            request_id = f"req_{g * 4999}"
            started = time.perf_counter()
            connection.execute(
                text("SELECT * FROM usage_events WHERE request_id = :r AND tenant_id = :t"),
                {"r": request_id, "t": "tenant-1"},
            ).all()
            timings.append(time.perf_counter() - started)
    engine.dispose()
    return statistics.median(timings) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--tenants", type=int, default=100)
    parser.add_argument("--database", default="tollgate_bench_usage")
    parser.add_argument("--reuse", action="store_true", help="keep the rows already there")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    url = ensure_database(args.database)
    if not args.reuse:
        fill(url, args.rows, args.tenants)
    for label, tenant_id in (
        ("largest tenant (10% of rows)", "tenant-0"),
        ("typical tenant", "tenant-1"),
    ):
        report_ms, requests = asyncio.run(time_report(url, tenant_id, args.repeats))
        plan, indexed_ms = explain(url, tenant_id, indexes=True)
        _, scan_ms = explain(url, tenant_id, indexes=False)
        print(f"\n{label}: {requests:,} requests in {MONTH.label}")
        print(f"  build_report (median of {args.repeats}): {report_ms:.1f} ms")
        print(
            f"  report query with the index: {indexed_ms:.1f} ms; "
            f"index scans off: {scan_ms:.1f} ms ({scan_ms / indexed_ms:.1f}x slower)"
        )
        print("  plan:")
        for line in plan:
            print("    " + line)
    print(f"\nper-request lookup (/v1/usage/requests/{{id}}), median: {time_lookup(url):.2f} ms")


if __name__ == "__main__":
    main()
