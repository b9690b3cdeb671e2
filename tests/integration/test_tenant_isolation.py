"""Tenant isolation: a key of tenant A reads nothing of tenant B, through every endpoint.

The route sweep probes every route the app serves, so an endpoint added later is covered
without editing this file; the tests after it check the endpoints that do serve a tenant
(generation, idempotent replay, usage) for what they must keep apart.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pytest
from litestar import Litestar
from litestar.routes import HTTPRoute
from litestar.testing import AsyncTestClient
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.dispatch.engine_client import InProcessEngineClient
from tenants.models import KeyRole, UsageEvent
from tenants.services import ApiKeyService, TenantService
from tests.conftest import eventually

Sessions = async_sessionmaker[AsyncSession]
_PARAM = re.compile(r"\{(\w+):\w+\}")
DENIED = {401, 403, 404}


@dataclass
class Tenant:
    name: str
    id: str
    key_id: str
    key_prefix: str
    secret: str
    request_id: str = ""
    completion: str = ""

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.secret}"}

    def identifiers(self) -> list[str]:
        """What must never appear in an answer to another tenant."""
        found = [self.name, self.id, self.key_id, self.key_prefix, self.secret, self.request_id]
        return [value for value in found if value] + [self.secret.split("_", 1)[1]]


async def _tenant(sessions: Sessions, name: str) -> Tenant:
    async with sessions.begin() as session:
        tenant = await TenantService(session).create(name)
        created = await ApiKeyService(session).create(tenant, "app", KeyRole.TENANT)
    return Tenant(name, tenant.id, created.key.id, created.key.prefix, created.secret)


def _completion(model: str, prompt: str = "The") -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0}


@pytest.fixture
async def pair(
    client: AsyncTestClient[Any], sessions: Sessions, engine_client: InProcessEngineClient
) -> tuple[Tenant, Tenant]:
    """Tenant A ('acme') and tenant B ('globex'), B with a finished idempotent request."""
    a, b = await _tenant(sessions, "acme"), await _tenant(sessions, "globex")
    response = await client.post(
        "/v1/completions",
        json=_completion(engine_client.model_name),
        headers={**b.auth, "Idempotency-Key": "shared-key-1"},
    )
    assert response.status_code == 200, response.text
    b.request_id = response.headers["x-request-id"]
    b.completion = response.json()["id"]
    return a, b


def _routes(app: Litestar) -> list[tuple[str, str]]:
    return sorted(
        (method, route.path)
        for route in app.routes
        if isinstance(route, HTTPRoute)
        for method in route.methods
        if method not in ("OPTIONS", "HEAD")
    )


def _fill(path: str, values: dict[str, str]) -> str:
    return _PARAM.sub(lambda match: values.get(match.group(1), "x"), path)


async def _call(
    client: AsyncTestClient[Any], method: str, path: str, headers: dict[str, str]
) -> Any:
    body: dict[str, Any] | None = {} if method in ("POST", "PATCH", "PUT") else None
    return await client.request(method, path, json=body, headers=headers, follow_redirects=False)


async def test_every_route_denies_or_hides_another_tenants_data(
    client: AsyncTestClient[Any], pair: tuple[Tenant, Tenant]
) -> None:
    a, b = pair
    month = datetime.now(UTC).strftime("%Y-%m")
    of_b = {
        "name": b.name,
        "tenant": b.name,
        "key": b.key_prefix,
        "request_id": b.request_id,
        "period": month,
    }
    nobody = {**of_b, "name": "nobody", "tenant": "nobody", "key": "tg-00000000"}
    nobody["request_id"] = "req_" + "0" * 32
    routes = _routes(client.app)
    assert ("POST", "/v1/completions") in routes and ("GET", "/admin/api/audit") in routes
    for method, path in routes:
        filled = _fill(path, of_b)
        response = await _call(client, method, filled, a.auth)
        answer = response.text + " ".join(response.headers.values())
        for identifier in b.identifiers():
            if identifier not in filled:  # echoing what the caller sent reveals nothing
                assert identifier not in answer, f"{method} {path} shows B's {identifier!r}"
        if _PARAM.search(path):
            # B's resources look exactly like resources that do not exist: no oracle.
            assert response.status_code in DENIED | {302, 303}, f"{method} {path}"
            missing = await _call(client, method, _fill(path, nobody), a.auth)
            echoed = missing.text
            for param, value in nobody.items():
                if value != of_b[param]:
                    echoed = echoed.replace(value, of_b[param])
            assert (missing.status_code, echoed) == (response.status_code, response.text), (
                f"{method} {path} answers differently for B's resource"
            )


async def test_a_tenant_key_cannot_use_the_admin_api_on_anyone(
    client: AsyncTestClient[Any], pair: tuple[Tenant, Tenant]
) -> None:
    a, b = pair
    admin_routes = [(m, p) for m, p in _routes(client.app) if p.startswith("/admin/api")]
    assert len(admin_routes) >= 12
    for method, path in admin_routes:
        filled = _fill(path, {"name": b.name, "key": b.key_prefix})
        response = await _call(client, method, filled, a.auth)
        assert response.status_code == 403, f"{method} {path}: {response.status_code}"


async def test_idempotency_keys_never_replay_another_tenants_result(
    client: AsyncTestClient[Any], pair: tuple[Tenant, Tenant], engine_client: InProcessEngineClient
) -> None:
    a, b = pair
    same_as_b = {**a.auth, "Idempotency-Key": "shared-key-1"}  # B's key, B's body
    first = await client.post(
        "/v1/completions", json=_completion(engine_client.model_name), headers=same_as_b
    )
    assert first.status_code == 200, first.text
    assert "idempotent-replayed" not in first.headers  # a fresh request, not B's result
    assert (first.json()["id"], first.headers["x-request-id"]) != (b.completion, b.request_id)
    again = await client.post(
        "/v1/completions", json=_completion(engine_client.model_name), headers=same_as_b
    )
    assert again.headers.get("idempotent-replayed") == "true"  # A's own first result
    assert again.json()["id"] == first.json()["id"]


async def test_usage_is_charged_to_the_callers_tenant_only(
    client: AsyncTestClient[Any],
    pair: tuple[Tenant, Tenant],
    sessions: Sessions,
    engine_client: InProcessEngineClient,
) -> None:
    a, b = pair
    response = await client.post(
        "/v1/completions", json=_completion(engine_client.model_name), headers=a.auth
    )
    assert response.status_code == 200
    async with sessions() as session:
        rows = (await session.execute(select(UsageEvent.request_id, UsageEvent.tenant_id))).all()
    owners = dict(rows)
    assert owners[response.headers["x-request-id"]] == a.id
    assert owners[b.request_id] == b.id


async def test_models_list_is_the_callers_own_view(
    client: AsyncTestClient[Any], pair: tuple[Tenant, Tenant]
) -> None:
    a, b = pair
    for tenant in (a, b):
        listed = await client.get("/v1/models", headers=tenant.auth)
        assert listed.status_code == 200
        other = b if tenant is a else a
        assert all(identifier not in listed.text for identifier in other.identifiers())


async def test_usage_endpoints_show_only_the_callers_own_ledger(
    client: AsyncTestClient[Any], pair: tuple[Tenant, Tenant], engine_client: InProcessEngineClient
) -> None:
    a, b = pair
    assert (
        await client.get(f"/v1/usage/requests/{b.request_id}", headers=a.auth)
    ).status_code == 404
    own = await client.get(f"/v1/usage/requests/{b.request_id}", headers=b.auth)
    assert own.status_code == 200 and own.json()["request_id"] == b.request_id

    before = (await client.get("/v1/usage", headers=a.auth)).json()
    b_before = (await client.get("/v1/usage", headers=b.auth)).json()
    more = await client.post(
        "/v1/completions", json=_completion(engine_client.model_name, "More"), headers=b.auth
    )
    assert more.status_code == 200

    async def b_usage_changed() -> bool:
        return bool((await client.get("/v1/usage", headers=b.auth)).json() != b_before)

    await eventually(b_usage_changed)  # the usage row may be written after the response
    assert (await client.get("/v1/usage", headers=a.auth)).json() == before  # B's use: not A's
