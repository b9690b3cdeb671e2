"""Quotas through the API, on the in-process store and on Redis."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import httpx
import pytest
from litestar import Litestar
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.app import create_app
from gateway.dispatch.engine_client import InProcessEngineClient
from gateway.runtime import Runtime
from gateway.settings import Settings
from tenants.limits import LimitSet, PlanTerms
from tenants.models import UsageEvent
from tenants.pricing import DEFAULT_PRICE
from tenants.quota import (
    Granted,
    Limits,
    ReserveRequest,
    Scope,
    key_scope,
    month_period,
    tenant_scope,
)
from tenants.services import ApiKeyService, PlanService, TenantService
from tests.conftest import REDIS_URL, serving

Sessions = async_sessionmaker[AsyncSession]


@pytest.fixture(params=["memory", "redis"])
async def app(
    request: pytest.FixtureRequest, settings: Settings, engine_client: InProcessEngineClient
) -> AsyncIterator[Litestar]:
    """Served by uvicorn in this event loop, so tests may read the app's quota store."""
    redis_url = REDIS_URL if request.param == "redis" else None
    app = create_app(replace(settings, redis_url=redis_url), engine_client=engine_client)
    async with serving(app) as base_url:
        app.state.base_url = base_url
        yield app


def _client(app: Litestar) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=app.state.base_url, timeout=60)


async def _tenant_key(sessions: Sessions, limits: LimitSet) -> tuple[str, str]:
    """A fresh tenant (unique, so Redis counters never collide) on a plan with `limits`."""
    name = f"t{uuid.uuid4().hex[:12]}"
    async with sessions.begin() as session:
        await PlanService(session).create(name, PlanTerms(limits=limits))
        await TenantService(session).create(name)
        tenant = await TenantService(session).set_plan(name, name)
        return tenant.id, (await ApiKeyService(session).create(tenant)).secret


def _body(model: str, max_tokens: int = 4) -> dict[str, Any]:
    return {"model": model, "prompt": "Return the", "max_tokens": max_tokens, "temperature": 0}


async def _ledger_cost(sessions: Sessions, tenant_id: str) -> int:
    async with sessions() as session:
        query = select(func.coalesce(func.sum(UsageEvent.cost_micros), 0)).where(
            UsageEvent.tenant_id == tenant_id
        )
        return int(await session.scalar(query) or 0)


async def test_budget_is_a_hard_cap_and_matches_the_ledger(
    app: Litestar, sessions: Sessions, engine_client: InProcessEngineClient
) -> None:
    model = engine_client.model_name
    prompt_tokens = len(engine_client.encode("Return the"))
    worst = DEFAULT_PRICE.cost_micros(prompt_tokens, 0, 4)
    tenant_id, key = await _tenant_key(sessions, LimitSet(monthly_budget_micros=3 * worst))
    headers = {"Authorization": f"Bearer {key}"}
    async with _client(app) as client:
        responses = await asyncio.gather(
            *(client.post("/v1/completions", json=_body(model), headers=headers) for _ in range(8))
        )
        codes = sorted(r.status_code for r in responses)
        runtime: Runtime = app.state.runtime
        await runtime.tasks.drain()
        usage = await runtime.admission.store.usage(tenant_scope(tenant_id), month_period())
    assert codes.count(200) >= 3  # three worst cases always fit; actual costs may fit more
    denied = [r for r in responses if r.status_code == 429]
    assert denied, codes
    assert all(r.json()["error"]["code"] == "insufficient_quota" for r in denied)
    assert "retry-after" not in denied[0].headers
    assert usage.reserved_micros == 0
    assert usage.concurrent == 0
    assert usage.spent_micros == await _ledger_cost(sessions, tenant_id)
    assert usage.spent_micros <= 3 * worst


async def test_requests_per_minute(
    app: Litestar, sessions: Sessions, engine_client: InProcessEngineClient
) -> None:
    _, key = await _tenant_key(sessions, LimitSet(rpm=2))
    headers = {"Authorization": f"Bearer {key}"}
    body = _body(engine_client.model_name, max_tokens=1)
    async with _client(app) as client:
        first = await client.post("/v1/completions", json=body, headers=headers)
        second = await client.post("/v1/completions", json=body, headers=headers)
        third = await client.post("/v1/completions", json=body, headers=headers)
    assert first.headers["x-ratelimit-limit-requests"] == "2"
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    assert second.headers["x-ratelimit-remaining-requests"] == "0"
    assert third.status_code == 429
    error = third.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
    assert 1 <= int(third.headers["retry-after"]) <= 60
    assert third.headers["x-ratelimit-remaining-requests"] == "0"


async def test_tokens_per_minute_counts_the_worst_case(
    app: Litestar, sessions: Sessions, engine_client: InProcessEngineClient
) -> None:
    prompt_tokens = len(engine_client.encode("Return the"))
    _, key = await _tenant_key(sessions, LimitSet(tpm=prompt_tokens + 10))
    headers = {"Authorization": f"Bearer {key}"}
    model = engine_client.model_name
    async with _client(app) as client:
        too_big = await client.post("/v1/completions", json=_body(model, 11), headers=headers)
        fits = await client.post("/v1/completions", json=_body(model, 10), headers=headers)
    assert too_big.status_code == 429
    assert fits.status_code == 200
    assert int(fits.headers["x-ratelimit-limit-tokens"]) == prompt_tokens + 10


async def test_key_override_limits_one_key_only(
    app: Litestar, sessions: Sessions, engine_client: InProcessEngineClient
) -> None:
    tenant_id, key = await _tenant_key(sessions, LimitSet(rpm=100))
    async with sessions.begin() as session:
        tenant = await TenantService(session).get_by_id(tenant_id)
        other = (await ApiKeyService(session).create(tenant)).secret
        await ApiKeyService(session).set_limits(key.split("_")[0], LimitSet(rpm=1))
    body = _body(engine_client.model_name, max_tokens=1)
    async with _client(app) as client:
        limited = [
            (
                await client.post(
                    "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
                )
            ).status_code
            for _ in range(2)
        ]
        free = await client.post(
            "/v1/completions", json=body, headers={"Authorization": f"Bearer {other}"}
        )
    assert limited == [200, 429]
    assert free.status_code == 200


async def test_rate_limit_headers_describe_the_binding_limit_of_key_or_tenant(
    app: Litestar, sessions: Sessions, engine_client: InProcessEngineClient
) -> None:
    """A key with rpm 1 on a plan with rpm 100 hears of the key's limit, on its 200 and
    its 429; a key limit under a plan without one still gets headers; where the tenant's
    window is the tighter, the tenant's."""
    _, key = await _tenant_key(sessions, LimitSet(rpm=100))
    _, unplanned = await _tenant_key(sessions, LimitSet())
    _, tight_plan = await _tenant_key(sessions, LimitSet(rpm=2, tpm=1000))
    async with sessions.begin() as session:
        keys = ApiKeyService(session)
        await keys.set_limits(key.split("_")[0], LimitSet(rpm=1))
        await keys.set_limits(unplanned.split("_")[0], LimitSet(rpm=3, tpm=500))
        await keys.set_limits(tight_plan.split("_")[0], LimitSet(rpm=50, tpm=10_000))
    body = _body(engine_client.model_name, max_tokens=1)

    def requests_headers(response: httpx.Response) -> tuple[int, str | None, str | None]:
        limit = response.headers.get("x-ratelimit-limit-requests")
        return response.status_code, limit, response.headers.get("x-ratelimit-remaining-requests")

    async with _client(app) as client:

        async def post(secret: str) -> httpx.Response:
            headers = {"Authorization": f"Bearer {secret}"}
            return await client.post("/v1/completions", json=body, headers=headers)

        limited = [requests_headers(await post(key)) for _ in range(2)]
        free = await post(unplanned)
        tight = await post(tight_plan)
    assert limited == [(200, "1", "0"), (429, "1", "0")]
    assert requests_headers(free) == (200, "3", "2")
    assert free.headers["x-ratelimit-limit-tokens"] == "500"
    assert requests_headers(tight) == (200, "2", "1")
    assert tight.headers["x-ratelimit-limit-tokens"] == "1000"


@pytest.mark.parametrize("limit", ["rpm", "budget"])
async def test_a_spent_key_costs_no_tokenizing(
    app: Litestar,
    sessions: Sessions,
    engine_client: InProcessEngineClient,
    monkeypatch: pytest.MonkeyPatch,
    limit: str,
) -> None:
    """A long prompt from a caller whose minute or budget is already used up is refused
    before it is tokenized (tokenizing megabytes cost seconds of CPU a quota never saw)."""
    body = {**_body(engine_client.model_name, max_tokens=1), "ignore_eos": True}
    exact = DEFAULT_PRICE.cost_micros(len(engine_client.encode(body["prompt"])), 0, 1)
    limits = LimitSet(rpm=1) if limit == "rpm" else LimitSet(monthly_budget_micros=exact)
    _, key = await _tenant_key(sessions, limits)
    headers = {"Authorization": f"Bearer {key}"}
    tokenized: list[int] = []
    encode = engine_client.encode

    def recording(text: str) -> list[int]:
        tokenized.append(len(text))
        return encode(text)

    async with _client(app) as client:
        spend = await client.post(
            "/v1/completions", json={**body, "ignore_eos": True}, headers=headers
        )
        assert spend.status_code == 200, spend.text  # uses up the minute or the budget
        runtime: Runtime = app.state.runtime
        await runtime.tasks.drain()  # its settlement is in the store
        monkeypatch.setattr(engine_client, "encode", recording)
        long = {**body, "prompt": "-" * 5000}
        refused = await client.post("/v1/completions", json=long, headers=headers)
    assert refused.status_code == 429, refused.text
    assert tokenized == []
    expected = "rate_limit_exceeded" if limit == "rpm" else "insufficient_quota"
    assert refused.json()["error"]["code"] == expected


async def test_many_empty_messages_from_a_spent_key_are_not_rendered(
    app: Litestar,
    sessions: Sessions,
    engine_client: InProcessEngineClient,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Messages count towards a long prompt (their template's characters), so 200 empty
    ones from a key whose minute is used up are refused before the template renders them
    (counting content alone, they were rendered first)."""
    _, key = await _tenant_key(sessions, LimitSet(rpm=1))
    headers = {"Authorization": f"Bearer {key}"}
    rendered: list[int] = []
    render = engine_client.render_chat

    def recording(messages: list[dict[str, Any]], tools: Any = None) -> str:
        rendered.append(len(messages))
        return render(messages, tools)

    async with _client(app) as client:
        spend = await client.post(
            "/v1/completions", json=_body(engine_client.model_name, 1), headers=headers
        )
        assert spend.status_code == 200, spend.text
        monkeypatch.setattr(engine_client, "render_chat", recording)
        turns = [{"role": "user", "content": None}] * 200
        body = {"model": engine_client.model_name, "messages": turns, "max_tokens": 1}
        refused = await client.post("/v1/chat/completions", json=body, headers=headers)
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert rendered == []


async def test_an_early_refusal_names_the_binding_limit_of_key_and_tenant(
    app: Litestar, sessions: Sessions, engine_client: InProcessEngineClient
) -> None:
    """A long prompt refused before it is tokenized (the key's minute is used up) carries
    the same x-ratelimit-* headers as reserve()'s refusal: the key's rpm 1, not the
    plan's 100; the plan's tpm where the key has none; when the window frees."""
    _, key = await _tenant_key(sessions, LimitSet(rpm=100, tpm=5000))
    async with sessions.begin() as session:
        await ApiKeyService(session).set_limits(key.split("_")[0], LimitSet(rpm=1))
    headers = {"Authorization": f"Bearer {key}"}
    body = _body(engine_client.model_name, max_tokens=1)
    async with _client(app) as client:
        spend = await client.post("/v1/completions", json=body, headers=headers)
        assert spend.status_code == 200, spend.text
        long = {**body, "prompt": "-" * 5000}
        refused = await client.post("/v1/completions", json=long, headers=headers)
    assert refused.status_code == 429, refused.text
    limit = refused.headers
    assert (limit["x-ratelimit-limit-requests"], limit["x-ratelimit-remaining-requests"]) == (
        "1",
        "0",
    )
    assert 0 < float(limit["x-ratelimit-reset-requests"].removesuffix("s")) <= 60
    assert limit["x-ratelimit-limit-tokens"] == "5000"
    assert 0 < int(limit["x-ratelimit-remaining-tokens"]) < 5000
    assert 1 <= int(limit["retry-after"]) <= 60


async def test_a_concurrency_refusal_names_the_concurrency_limit(
    app: Litestar, sessions: Sessions, engine_client: InProcessEngineClient
) -> None:
    """A key whose one concurrent slot is taken is refused, at reserve() and before
    tokenizing, with its concurrency limit, Retry-After and the binding windows."""
    _, key = await _tenant_key(sessions, LimitSet(rpm=100))
    async with sessions.begin() as session:
        keys = ApiKeyService(session)
        await keys.set_limits(key.split("_")[0], LimitSet(max_concurrent=1))
        key_id = (await keys.get(key.split("_")[0])).id
    runtime: Runtime = app.state.runtime
    held = ReserveRequest(  # an in-flight request of this key holds its one slot
        reservation_id=f"held{uuid.uuid4().hex[:8]}",
        scopes=(Scope(key_scope(key_id), Limits(max_concurrent=1)),),
        tokens=1,
        cost_micros=0,
        period=month_period(),
        lease_s=60,
    )
    assert isinstance(await runtime.admission.store.reserve(held), Granted)
    headers = {"Authorization": f"Bearer {key}"}
    body = _body(engine_client.model_name, max_tokens=1)
    async with _client(app) as client:
        short = await client.post("/v1/completions", json=body, headers=headers)
        long = {**body, "prompt": "-" * 5000}
        early = await client.post("/v1/completions", json=long, headers=headers)
    await runtime.admission.store.settle(held.reservation, 0, 0)
    for refused in (short, early):
        assert refused.status_code == 429, refused.text
        assert refused.headers["x-ratelimit-limit-concurrent-requests"] == "1"
        assert refused.headers["x-ratelimit-remaining-concurrent-requests"] == "0"
        assert refused.headers["retry-after"] == "1"
        assert refused.headers["x-ratelimit-limit-requests"] == "100"
