"""Billing reports: totals equal the ledger rows; CSV parses back to the same numbers;
the admin JSON and CSV routes and `tollgate billing report`."""

from __future__ import annotations

import asyncio
import csv
import io
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from litestar.testing import AsyncTestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from gateway.cli import commands as cli
from tenants import audit, db
from tenants.billing.export import sync_engine
from tenants.billing.export_lock import ExportLock
from tenants.billing.models import OutboxRow, OutboxStatus
from tenants.billing.reports import CSV_FIELDS, Period, build_report, format_micros
from tenants.errors import InvalidInputError
from tenants.models import KeyRole, Tenant, UsageEvent
from tests.integration.billing_support import Owner, Sessions, ledger_rows, owner

NOVEMBER = Period.parse("2026-11")


def moments(count: int, start: datetime, step: timedelta) -> list[datetime]:
    return [start + step * index for index in range(count)]


def expected(rows: list[UsageEvent]) -> dict[str, int]:
    return {
        "requests": len(rows),
        "input_tokens": sum(r.prompt_tokens - r.cached_tokens for r in rows),
        "cached_input_tokens": sum(r.cached_tokens for r in rows),
        "output_tokens": sum(r.completion_tokens for r in rows),
        "cost_micros": sum(r.cost_micros for r in rows),
    }


async def november(sessions: Sessions, who: Owner) -> list[UsageEvent]:
    """Rows across November, plus rows just outside it that the report must leave out."""
    inside = await ledger_rows(
        sessions, who, moments(90, NOVEMBER.start, timedelta(hours=7, minutes=59)), seed=2
    )
    edges = [NOVEMBER.start - timedelta(microseconds=1), NOVEMBER.end]
    await ledger_rows(sessions, who, edges, seed=3)
    return inside


async def test_report_totals_equal_the_ledger_rows(sessions: Sessions) -> None:
    acme = await owner(sessions, "acme")
    rows = await november(sessions, acme)
    other = await owner(sessions, "globex")
    await ledger_rows(sessions, other, [NOVEMBER.start + timedelta(days=3)], seed=4)

    async with sessions() as session:
        report = await build_report(
            session, await session.get_one(Tenant, acme.tenant_id), NOVEMBER
        )
    view = report.view()
    assert view["totals"] == expected(rows)
    for model in ("tiny", "small"):
        line = next(m for m in view["by_model"] if m["model"] == model)
        assert line == {"model": model, **expected([r for r in rows if r.model == model])}
    for day in view["daily"]:
        on = datetime.fromisoformat(day["date"]).date()
        same_day = [r for r in rows if r.created_at.date() == on]
        assert day == {"date": day["date"], **expected(same_day)}
    assert sum(view["by_status"].values()) == len(rows)
    invoice = view["invoice_preview"]
    assert invoice["total_micros"] == sum(r.cost_micros for r in rows)
    assert sum(line["amount_micros"] for line in invoice["lines"]) == invoice["total_micros"]
    assert invoice["total"] == format_micros(invoice["total_micros"])


async def test_csv_parses_back_to_the_report_numbers(sessions: Sessions) -> None:
    acme = await owner(sessions, "acme")
    rows = await november(sessions, acme)
    async with sessions() as session:
        report = await build_report(
            session, await session.get_one(Tenant, acme.tenant_id), NOVEMBER
        )

    parsed = list(csv.DictReader(io.StringIO(report.csv())))
    assert tuple(parsed[0].keys()) == CSV_FIELDS
    summed = {name: sum(int(line[name]) for line in parsed) for name in CSV_FIELDS[2:]}
    assert summed == report.totals.view() == expected(rows)
    assert {line["model"] for line in parsed} == {r.model for r in rows}


def test_periods_are_utc_months() -> None:
    december = Period.parse("2026-12")
    assert (december.start, december.end) == (
        datetime(2026, 12, 1, tzinfo=UTC),
        datetime(2027, 1, 1, tzinfo=UTC),
    )
    for bad in ("2026-13", "2026-00", "26-11", "2026/11", ""):
        with pytest.raises(InvalidInputError):
            Period.parse(bad)
    assert format_micros(1_234_567) == "1.234567" and format_micros(5) == "0.000005"


async def test_admin_report_routes_and_csv_export_is_audited(
    client: AsyncTestClient[Any], sessions: Sessions
) -> None:
    admin = await owner(sessions, "ops", KeyRole.ADMIN)
    acme = await owner(sessions, "acme")
    rows = await november(sessions, acme)

    report = await client.get("/admin/api/billing/reports/acme/2026-11", headers=admin.headers)
    assert report.status_code == 200, report.text
    assert report.json()["totals"] == expected(rows)

    exported = await client.get(
        "/admin/api/billing/reports/acme/2026-11/csv", headers=admin.headers
    )
    assert exported.headers["content-type"].startswith("text/csv")
    assert "tollgate-acme-2026-11.csv" in exported.headers["content-disposition"]
    lines = list(csv.DictReader(io.StringIO(exported.text)))
    assert sum(int(line["cost_micros"]) for line in lines) == expected(rows)["cost_micros"]
    async with sessions() as session:
        events = await audit.list_events(session, action="billing.report.export")
    assert len(events) == 1 and events[0].tenant_id == acme.tenant_id
    assert events[0].actor.startswith("key:") and events[0].details["period"] == "2026-11"

    missing = await client.get("/admin/api/billing/reports/nobody/2026-11", headers=admin.headers)
    assert missing.status_code == 404
    bad = await client.get("/admin/api/billing/reports/acme/2026-13", headers=admin.headers)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "period"
    denied = await client.get("/admin/api/billing/reports/acme/2026-11", headers=acme.headers)
    assert denied.status_code == 403


def test_cli_billing_report(
    database_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    async def seed() -> list[UsageEvent]:
        engine = db.create_engine(database_url)
        try:
            sessions = db.session_factory(engine)
            return await november(sessions, await owner(sessions, "acme"))
        finally:
            await engine.dispose()

    rows = asyncio.run(seed())
    monkeypatch.setenv("TOLLGATE_DATABASE_URL", database_url)

    assert cli.main(["billing", "report", "--tenant", "acme", "--period", "2026-11"]) == 0
    table = capsys.readouterr().out
    assert format_micros(expected(rows)["cost_micros"]) in table and "tiny" in table

    assert cli.main(["billing", "report", "--tenant", "nobody", "--period", "2026-11"]) == 2
    assert "nobody" in capsys.readouterr().err


async def test_admin_links_a_tenant_to_a_stripe_customer(
    client: AsyncTestClient[Any], sessions: Sessions
) -> None:
    admin = await owner(sessions, "ops", KeyRole.ADMIN)
    await owner(sessions, "acme")
    await owner(sessions, "globex")
    path = "/admin/api/billing/customers/acme"

    assert (await client.get(path, headers=admin.headers)).json()["customer_id"] is None
    linked = await client.put(path, json={"customer_id": "cus_Acme1"}, headers=admin.headers)
    assert linked.status_code == 200, linked.text
    assert (await client.get(path, headers=admin.headers)).json() == {
        "tenant": "acme",
        "customer_id": "cus_Acme1",
    }
    taken = await client.put(
        "/admin/api/billing/customers/globex",
        json={"customer_id": "cus_Acme1"},
        headers=admin.headers,
    )
    assert taken.status_code == 409
    bad = await client.put(path, json={"customer_id": "acme"}, headers=admin.headers)
    assert bad.status_code == 400
    missing = await client.get("/admin/api/billing/customers/nobody", headers=admin.headers)
    assert missing.status_code == 404


async def test_admin_export_status_and_requeue(
    client: AsyncTestClient[Any], sessions: Sessions
) -> None:
    admin = await owner(sessions, "ops", KeyRole.ADMIN)
    await november(sessions, await owner(sessions, "acme"))
    async with sessions() as session:
        billable = await session.scalar(
            select(func.count()).select_from(UsageEvent).where(UsageEvent.cost_micros > 0)
        )
    status = await client.get("/admin/api/billing/export", headers=admin.headers)
    assert status.json()["stripe"] is False  # no TOLLGATE_STRIPE_API_KEY here
    assert billable is not None and status.json()["pending"] == billable > 0
    assert status.json()["exported"] == status.json()["failed"] == 0
    requeued = await client.post("/admin/api/billing/export/requeue", headers=admin.headers)
    assert requeued.json() == {"requeued": 0}
    refused = await client.post("/admin/api/billing/export", headers=admin.headers)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "stripe_disabled"


async def test_admin_export_meets_the_lock_and_resolves_unconfirmed_rows(
    client: AsyncTestClient[Any], sessions: Sessions, database_url: str
) -> None:
    admin = await owner(sessions, "ops", KeyRole.ADMIN)
    await november(sessions, await owner(sessions, "acme"))
    runtime = client.app.state.runtime
    runtime.settings = replace(
        runtime.settings, stripe_api_key="sk_test_on", stripe_base_url="http://127.0.0.1:9"
    )
    engine = sync_engine(database_url)
    try:
        with ExportLock(engine).hold():  # another run, say the Celery worker's
            busy = await client.post("/admin/api/billing/export", headers=admin.headers)
        with Session(engine) as session, session.begin():
            row = session.scalars(select(OutboxRow)).first()
            assert row is not None
            row.status = OutboxStatus.UNCONFIRMED
            row_id = row.id
    finally:
        engine.dispose()
    assert busy.status_code == 409 and busy.json()["error"]["code"] == "export_running"
    resolved = await client.post(
        "/admin/api/billing/export/resolve",
        json={"in_stripe": True, "rows": [row_id]},
        headers=admin.headers,
    )
    assert resolved.json() == {"resolved": 1, "in_stripe": True}
    status = (await client.get("/admin/api/billing/export", headers=admin.headers)).json()
    assert (status["exported"], status["unconfirmed"]) == (1, 0)
    async with sessions() as reader:
        [event] = await audit.list_events(reader, action="billing.export.resolve")
    assert event.details == {"rows": 1, "in_stripe": True, "only": [row_id]}
