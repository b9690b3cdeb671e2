"""The admin JSON API: plans, tenants, keys and limits, for admin keys only."""

from __future__ import annotations

from typing import Any

from litestar.testing import AsyncTestClient
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.dispatch.engine_client import InProcessEngineClient
from tenants import audit
from tenants.models import KeyRole
from tenants.services import ApiKeyService, TenantService

Sessions = async_sessionmaker[AsyncSession]


async def _admin_key(sessions: Sessions) -> str:
    async with sessions.begin() as session:
        tenant = await TenantService(session).create("ops")
        return (await ApiKeyService(session).create(tenant, "root", KeyRole.ADMIN)).secret


async def test_onboarding_through_the_admin_api(
    client: AsyncTestClient[Any], sessions: Sessions, engine_client: InProcessEngineClient
) -> None:
    admin = {"Authorization": f"Bearer {await _admin_key(sessions)}"}
    plan = await client.post(
        "/admin/api/plans",
        json={"name": "starter", "rpm": 60, "monthly_budget_micros": 5_000_000, "max_priority": 2},
        headers=admin,
    )
    assert plan.status_code == 201, plan.text
    assert plan.json()["rpm"] == 60 and plan.json()["tpm"] is None
    patched = await client.patch(
        "/admin/api/plans/starter", json={"tpm": 1000, "rpm": None}, headers=admin
    )
    assert (patched.json()["tpm"], patched.json()["rpm"]) == (1000, None)
    capped = await client.patch(  # past 2**31: a byte count, not a 32-bit limit
        "/admin/api/plans/starter", json={"max_file_bytes": 5 * 2**30}, headers=admin
    )
    assert (capped.json()["max_file_bytes"], capped.json()["tpm"]) == (5 * 2**30, 1000)

    tenant = await client.post(
        "/admin/api/tenants", json={"name": "globex", "plan": "starter"}, headers=admin
    )
    assert tenant.status_code == 201 and tenant.json()["plan"] == "starter"
    created = await client.post(
        "/admin/api/tenants/globex/keys", json={"name": "ci"}, headers=admin
    )
    secret = created.json()["key"]
    listed = await client.get("/admin/api/tenants/globex/keys", headers=admin)
    assert [k["prefix"] for k in listed.json()] == [created.json()["prefix"]]
    assert "key" not in listed.json()[0]  # the secret is shown once, at creation

    limits = await client.patch(
        f"/admin/api/keys/{created.json()['prefix']}/limits", json={"rpm": 5}, headers=admin
    )
    assert limits.json()["limits"]["rpm"] == 5

    tenant_call = {"Authorization": f"Bearer {secret}"}
    body = {"model": engine_client.model_name, "prompt": "The", "max_tokens": 2}
    assert (await client.post("/v1/completions", json=body, headers=tenant_call)).is_success
    usage = await client.get("/admin/api/tenants/globex/usage", headers=admin)
    assert usage.json()["spent_micros"] > 0
    assert usage.json()["requests_last_minute"] == 1

    revoked = await client.post(f"/admin/api/keys/{created.json()['id']}/revoke", headers=admin)
    assert revoked.json()["status"] == "revoked"
    assert (await client.post("/v1/completions", json=body, headers=tenant_call)).status_code == 401


async def test_tenant_keys_cannot_administer(client: AsyncTestClient[Any], tenant_key: str) -> None:
    response = await client.get(
        "/admin/api/plans", headers={"Authorization": f"Bearer {tenant_key}"}
    )
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "admin_required"
    assert (await client.get("/admin/api/plans")).status_code == 401


async def test_admin_api_validates_bodies(client: AsyncTestClient[Any], sessions: Sessions) -> None:
    admin = {"Authorization": f"Bearer {await _admin_key(sessions)}"}
    bad = await client.post("/admin/api/plans", json={"name": "x", "rpm": -1}, headers=admin)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "rpm"
    unknown = await client.post("/admin/api/plans", json={"name": "x", "rmp": 1}, headers=admin)
    assert unknown.status_code == 400
    missing = await client.patch("/admin/api/plans/nothing", json={"rpm": 1}, headers=admin)
    assert missing.status_code == 404
    twice = [
        await client.post("/admin/api/tenants", json={"name": "dup"}, headers=admin)
        for _ in range(2)
    ]
    assert [r.status_code for r in twice] == [201, 409]


async def test_a_refused_request_commits_nothing(
    client: AsyncTestClient[Any], sessions: Sessions
) -> None:
    """The request's transaction rolls back when the handler fails half way: the tenant
    the service already flushed is gone, and so is its audit row."""
    admin = {"Authorization": f"Bearer {await _admin_key(sessions)}"}
    refused = await client.post(
        "/admin/api/tenants", json={"name": "globex", "plan": "missing"}, headers=admin
    )
    assert refused.status_code == 404, refused.text
    async with sessions() as session:
        assert await TenantService(session).find("globex") is None
        created = await audit.list_events(session, action="tenant.create")
    assert [event.target for event in created] == ["tenant:ops"]  # the admin key's own
