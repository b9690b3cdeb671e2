"""GET /v1/usage: the calling tenant's usage and spend, and nothing of any other tenant."""

from __future__ import annotations

from typing import Any

from litestar.testing import AsyncTestClient
from sqlalchemy import func, select

from gateway.dispatch.engine_client import InProcessEngineClient
from tenants.billing.reports import Period
from tenants.models import KeyRole, UsageEvent
from tests.integration.billing_support import Owner, Sessions, owner


async def complete(
    client: AsyncTestClient[Any], who: Owner, engine: InProcessEngineClient, priority: int = 4
) -> str:
    body = {"model": engine.model_name, "prompt": "The", "max_tokens": 3, "priority": priority}
    response = await client.post("/v1/completions", json=body, headers=who.headers)
    assert response.status_code == 200, response.text
    return response.headers["x-request-id"]


async def test_usage_shows_the_callers_own_ledger(
    client: AsyncTestClient[Any], sessions: Sessions, engine_client: InProcessEngineClient
) -> None:
    acme = await owner(sessions, "acme")
    request_ids = [await complete(client, acme, engine_client) for _ in range(2)]

    usage = await client.get("/v1/usage", headers=acme.headers)
    assert usage.status_code == 200, usage.text
    body = usage.json()
    async with sessions() as session:
        spent = await session.scalar(
            select(func.sum(UsageEvent.cost_micros)).where(UsageEvent.tenant_id == acme.tenant_id)
        )
    assert body["object"] == "usage" and body["tenant"] == "acme"
    assert body["period"] == Period.current().label
    assert body["totals"]["requests"] == 2
    assert spent is not None and body["totals"]["cost_micros"] == spent > 0
    assert [m["model"] for m in body["by_model"]] == [engine_client.model_name]

    row = await client.get(f"/v1/usage/requests/{request_ids[0]}", headers=acme.headers)
    assert row.status_code == 200, row.text
    detail = row.json()
    assert detail["request_id"] == request_ids[0] and detail["status"] == "completed"
    assert detail["priority"] == 4 and detail["started_at"] is not None
    assert detail["completion_tokens"] > 0 and detail["ttft_ms"] is not None
    assert detail["price_version_id"] is None  # the built-in price: no version set


async def test_a_tenant_cannot_read_another_tenants_usage(
    client: AsyncTestClient[Any], sessions: Sessions, engine_client: InProcessEngineClient
) -> None:
    acme = await owner(sessions, "acme")
    globex = await owner(sessions, "globex")
    acme_request = await complete(client, acme, engine_client)

    theirs = await client.get("/v1/usage", headers=globex.headers)
    assert theirs.json()["tenant"] == "globex" and theirs.json()["totals"]["requests"] == 0
    other_row = await client.get(f"/v1/usage/requests/{acme_request}", headers=globex.headers)
    assert other_row.status_code == 404
    unknown = await client.get("/v1/usage/requests/req_nothing", headers=globex.headers)
    assert other_row.json() == {
        "error": {**unknown.json()["error"], "message": f"no request {acme_request!r}"}
    }  # the same answer as for a request that does not exist

    for path in (
        "/admin/api/billing/reports/acme/2026-11",
        "/admin/api/billing/reports/acme/2026-11/csv",
        "/admin/api/prices",
        "/admin/api/billing/customers/acme",
        "/admin/api/billing/export",
    ):
        denied = await client.get(path, headers=globex.headers)
        assert denied.status_code == 403, path
    for path in ("/admin/api/billing/export", "/admin/api/billing/export/requeue"):
        assert (await client.post(path, headers=globex.headers)).status_code == 403, path
    assert (await client.get("/v1/usage")).status_code == 401


async def test_usage_for_a_past_period_and_bad_periods(
    client: AsyncTestClient[Any], sessions: Sessions
) -> None:
    acme = await owner(sessions, "acme")
    past = await client.get("/v1/usage", params={"period": "2020-01"}, headers=acme.headers)
    assert past.status_code == 200 and past.json()["totals"]["requests"] == 0
    bad = await client.get("/v1/usage", params={"period": "January"}, headers=acme.headers)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "period"


async def test_admin_keys_see_their_own_tenant_too(
    client: AsyncTestClient[Any], sessions: Sessions
) -> None:
    ops = await owner(sessions, "ops", KeyRole.ADMIN)
    usage = await client.get("/v1/usage", headers=ops.headers)
    assert usage.status_code == 200 and usage.json()["tenant"] == "ops"
