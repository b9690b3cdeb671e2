"""A plan's terms — models, output length, priority — applied by the gateway."""

from __future__ import annotations

from typing import Any

from litestar.testing import AsyncTestClient
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.dispatch.engine_client import InProcessEngineClient
from tenants.limits import LimitSet, PlanTerms
from tenants.services import ApiKeyService, PlanService, TenantService

Sessions = async_sessionmaker[AsyncSession]


async def _key_on_plan(sessions: Sessions, terms: PlanTerms) -> str:
    async with sessions.begin() as session:
        await PlanService(session).create("basic", terms)
        await TenantService(session).create("acme")
        tenant = await TenantService(session).set_plan("acme", "basic")
        return (await ApiKeyService(session).create(tenant)).secret


def _completion(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "prompt": "The", "temperature": 0, "ignore_eos": True, **extra}


async def test_models_outside_the_plan_are_403_and_hidden(
    client: AsyncTestClient[Any], sessions: Sessions, engine_client: InProcessEngineClient
) -> None:
    key = await _key_on_plan(sessions, PlanTerms(allowed_models=frozenset({"other-model"})))
    headers = {"Authorization": f"Bearer {key}"}
    response = await client.post(
        "/v1/completions", json=_completion(engine_client.model_name), headers=headers
    )
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "model_not_allowed"
    assert (await client.get("/v1/models", headers=headers)).json()["data"] == []


async def test_max_tokens_per_request_caps_and_rejects(
    client: AsyncTestClient[Any], sessions: Sessions, engine_client: InProcessEngineClient
) -> None:
    key = await _key_on_plan(sessions, PlanTerms(limits=LimitSet(max_tokens_per_request=3)))
    headers = {"Authorization": f"Bearer {key}"}
    model = engine_client.model_name
    capped = await client.post("/v1/completions", json=_completion(model), headers=headers)
    assert capped.status_code == 200
    assert capped.json()["usage"]["completion_tokens"] == 3
    too_many = await client.post(
        "/v1/completions", json=_completion(model, max_tokens=4), headers=headers
    )
    assert too_many.status_code == 400
    assert too_many.json()["error"]["param"] == "max_tokens"


async def test_key_override_tightens_the_plan(
    client: AsyncTestClient[Any], sessions: Sessions, engine_client: InProcessEngineClient
) -> None:
    key = await _key_on_plan(sessions, PlanTerms(limits=LimitSet(max_tokens_per_request=10)))
    async with sessions.begin() as session:
        await ApiKeyService(session).set_limits(
            key.split("_")[0], LimitSet(max_tokens_per_request=2)
        )
    response = await client.post(
        "/v1/completions",
        json=_completion(engine_client.model_name),
        headers={"Authorization": f"Bearer {key}"},
    )
    assert response.json()["usage"]["completion_tokens"] == 2


async def test_priority_above_the_plan_is_403(
    client: AsyncTestClient[Any], sessions: Sessions, engine_client: InProcessEngineClient
) -> None:
    key = await _key_on_plan(sessions, PlanTerms(default_priority=6, max_priority=3))
    headers = {"Authorization": f"Bearer {key}"}
    model = engine_client.model_name
    urgent = await client.post(
        "/v1/completions", json=_completion(model, max_tokens=1, priority=1), headers=headers
    )
    assert urgent.status_code == 403
    assert urgent.json()["error"]["param"] == "priority"
    allowed = await client.post(
        "/v1/completions", json=_completion(model, max_tokens=1, priority=3), headers=headers
    )
    assert allowed.status_code == 200
