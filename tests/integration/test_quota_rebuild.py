"""Spend survives the quota store: a Redis restart (its own redis-server, which keeps
nothing on disk) never lets a tenant be admitted past its budget, whenever it comes
(just after a reconciler run) and however old the spend is (more than an hour)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from datetime import timedelta

import httpx
import pytest
from litestar import Litestar
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.admission.reconcile import period_bounds, rebuild
from gateway.app import create_app
from gateway.cli import commands as cli
from gateway.dispatch.engine_client import InProcessEngineClient
from gateway.runtime import Runtime
from gateway.settings import Settings
from tenants.limits import LimitSet, PlanTerms
from tenants.models import UsageEvent, utcnow
from tenants.pricing import DEFAULT_PRICE
from tenants.quota import RedisQuotaStore, ScopeUsage, key_scope, month_period, tenant_scope
from tenants.services import ApiKeyService, PlanService, TenantService, UsageService
from tests.conftest import eventually, serving
from tests.support.redis_server import RedisServer, redis_server

pytestmark = pytest.mark.integration

Sessions = async_sessionmaker[AsyncSession]
PROMPT = "Return the"
MAX_TOKENS = 4
LEASE_S = 2  # the rebuild's hold after a restart is half of it


@dataclass
class Stack:
    app: Litestar
    url: str
    redis: RedisServer

    @property
    def runtime(self) -> Runtime:
        runtime: Runtime = self.app.state.runtime
        return runtime


@pytest.fixture
async def stack(settings: Settings, engine_client: InProcessEngineClient) -> AsyncIterator[Stack]:
    async with redis_server() as redis:
        config = replace(settings, redis_url=redis.url, lease_s=LEASE_S)
        app = create_app(config, engine_client=engine_client)
        async with serving(app) as url:
            yield Stack(app, url, redis)


@dataclass
class Tenant:
    id: str
    key_id: str
    secret: str


async def _tenant(sessions: Sessions, budget: int) -> Tenant:
    name = f"t{uuid.uuid4().hex[:12]}"
    async with sessions.begin() as session:
        await PlanService(session).create(
            name, PlanTerms(limits=LimitSet(monthly_budget_micros=budget))
        )
        await TenantService(session).create(name)
        tenant = await TenantService(session).set_plan(name, name)
        created = await ApiKeyService(session).create(tenant)
        return Tenant(tenant.id, created.key.id, created.secret)


async def _old_spend(sessions: Sessions, tenant: Tenant, cost: int) -> None:
    """A row from more than an hour ago (or the month's first second, early in a month)."""
    start, _ = period_bounds(month_period())
    when = max(start + timedelta(seconds=1), utcnow() - timedelta(hours=2))
    async with sessions.begin() as session:
        await UsageService(session).record(
            UsageEvent(
                request_id=f"req_{uuid.uuid4().hex}",
                tenant_id=tenant.id,
                api_key_id=tenant.key_id,
                model="m",
                endpoint="completions",
                status="completed",
                cost_micros=cost,
                created_at=when,
            )
        )


async def _ledger(sessions: Sessions, tenant: Tenant) -> int:
    async with sessions() as session:
        query = select(func.coalesce(func.sum(UsageEvent.cost_micros), 0)).where(
            UsageEvent.tenant_id == tenant.id
        )
        return int(await session.scalar(query) or 0)


async def _wave(stack: Stack, tenant: Tenant, count: int, model: str) -> list[httpx.Response]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    headers = {"Authorization": f"Bearer {tenant.secret}"}
    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as http:
        return await asyncio.gather(
            *(http.post("/v1/completions", json=body, headers=headers) for _ in range(count))
        )


async def _usage(stack: Stack, tenant: Tenant) -> ScopeUsage:
    return await stack.runtime.admission.store.usage(tenant_scope(tenant.id), month_period())


async def test_redis_restart_just_after_a_reconcile_never_admits_past_the_budget(
    stack: Stack, sessions: Sessions, engine_client: InProcessEngineClient
) -> None:
    model = engine_client.model_name
    worst = DEFAULT_PRICE.cost_micros(len(engine_client.encode(PROMPT)), 0, MAX_TOKENS)
    budget = 12 * worst
    tenant = await _tenant(sessions, budget)
    await _old_spend(sessions, tenant, 6 * worst)  # half the budget, spent hours ago
    runtime = stack.runtime
    first = await _wave(stack, tenant, 3, model)
    assert [r.status_code for r in first] == [200] * 3
    # The worst moment: a reconciler run has just finished when Redis comes back empty.
    assert (await rebuild(runtime.sessions, runtime.admission.store)).ready
    assert (await _usage(stack, tenant)).spent_micros == await _ledger(sessions, tenant)
    await stack.redis.restart()
    restarted = time.monotonic()
    resumed: list[float] = []

    codes: list[int] = []

    async def budget_used_up() -> bool:  # waves of 10 until the budget refuses
        codes.extend(r.status_code for r in await _wave(stack, tenant, 10, model))
        if 200 in codes and not resumed:
            resumed.append(time.monotonic() - restarted)
        usage = await _usage(stack, tenant)
        assert usage.spent_micros + usage.reserved_micros <= budget
        return 429 in codes

    await eventually(budget_used_up, timeout_s=30)
    refused = codes.count(503)
    admitted = codes.count(200)
    print(
        f"\nafter the restart: {admitted} admitted, {refused} refused while rebuilding "
        f"(admission resumed {resumed[0]:.2f} s after it), {codes.count(429)} over budget; "
        f"ledger {await _ledger(sessions, tenant)} of a budget of {budget}"
    )
    assert set(codes) <= {200, 429, 503}, codes
    ledger = await _ledger(sessions, tenant)
    assert ledger <= budget, (ledger, budget)

    async def settled() -> bool:
        usage = await _usage(stack, tenant)
        return usage.reserved_micros == 0 and usage.spent_micros == ledger

    await eventually(settled, timeout_s=10)


async def test_refused_while_rebuilding_is_a_503_with_retry_after(
    stack: Stack, sessions: Sessions, engine_client: InProcessEngineClient
) -> None:
    tenant = await _tenant(sessions, 10**9)
    await stack.redis.restart()
    responses = await _wave(stack, tenant, 1, engine_client.model_name)
    assert responses[0].status_code in (200, 503)
    if responses[0].status_code == 503:  # within the hold after the rebuild
        assert responses[0].headers["retry-after"] == "1"
        assert responses[0].json()["error"]["code"] == "spend_rebuilding"

    async def admitted() -> bool:
        return (await _wave(stack, tenant, 1, engine_client.model_name))[0].status_code == 200

    await eventually(admitted, timeout_s=10)


async def _request(
    http: httpx.AsyncClient, tenant: Tenant, model: str, *, stream: bool
) -> tuple[int, str]:
    """Status and body of one request of 400 tokens (a stream's body: all its events)."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {tenant.secret}"}
    if not stream:
        response = await http.post("/v1/completions", json=body, headers=headers)
        return response.status_code, response.text
    async with http.stream(
        "POST", "/v1/completions", json=body | {"stream": True}, headers=headers
    ) as response:
        return response.status_code, "".join([line async for line in response.aiter_lines()])


async def test_store_down_during_settlement_still_answers_and_catches_up(
    stack: Stack, sessions: Sessions, engine_client: InProcessEngineClient
) -> None:
    tenant = await _tenant(sessions, 10**9)
    model = engine_client.model_name
    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as http:
        requests = [
            asyncio.create_task(_request(http, tenant, model, stream=i % 2 == 0)) for i in range(8)
        ]

        async def all_admitted() -> bool:
            return (await _usage(stack, tenant)).concurrent == 8

        await eventually(all_admitted, timeout_s=30)
        stack.redis.stop()  # they finish, and settle, while the store is away
        results = await asyncio.gather(*requests)
        assert stack.runtime.admission.unsettled > 0
        await stack.redis.start()  # back, and empty
        for status, text in results:
            assert status == 200, text
        streams = [text for _, text in results[0::2]]  # even ones streamed
        assert all(text.rstrip().endswith("data: [DONE]") for text in streams), streams
        ledger = await _ledger(sessions, tenant)
        assert ledger > 0

        async def caught_up() -> bool:
            if stack.runtime.admission.unsettled:
                return False
            await rebuild(stack.runtime.sessions, stack.runtime.admission.store)
            usage = await _usage(stack, tenant)
            return usage.spent_micros == ledger and usage.reserved_micros == 0

        await eventually(caught_up, timeout_s=20)


async def test_dropped_connections_during_settlement_are_retried(
    stack: Stack, sessions: Sessions, engine_client: InProcessEngineClient
) -> None:
    tenant = await _tenant(sessions, 10**9)
    model = engine_client.model_name
    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as http:
        requests = [
            asyncio.create_task(_request(http, tenant, model, stream=i % 2 == 0)) for i in range(8)
        ]

        async def all_admitted() -> bool:
            return (await _usage(stack, tenant)).concurrent == 8

        await eventually(all_admitted, timeout_s=30)
        assert await stack.redis.drop_connections() > 0  # every pooled connection is dead
        results = await asyncio.gather(*requests)
    assert [status for status, _ in results] == [200] * 8
    ledger = await _ledger(sessions, tenant)

    async def settled() -> bool:
        usage = await _usage(stack, tenant)
        return usage.spent_micros == ledger and usage.reserved_micros == 0

    await eventually(settled, timeout_s=10)


async def test_quota_rebuild_command(
    database_url: str,
    sessions: Sessions,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    tenant = await _tenant(sessions, 10**9)
    await _old_spend(sessions, tenant, 4321)
    async with redis_server() as redis:
        monkeypatch.setenv("TOLLGATE_DATABASE_URL", database_url)
        monkeypatch.setenv("TOLLGATE_REDIS_URL", redis.url)
        assert await asyncio.to_thread(cli.main, ["quota", "rebuild"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert (report["period"], report["ready"], report["scopes"]) == (month_period(), True, 2)
        store = RedisQuotaStore.from_url(redis.url)
        try:
            assert (await store.usage(tenant_scope(tenant.id), month_period())).spent_micros == 4321
            assert (
                await store.usage(key_scope(tenant.key_id), month_period())
            ).spent_micros == 4321
            assert await store.is_ready(month_period())
        finally:
            await store.aclose()
    with pytest.raises(SystemExit):
        cli.main(["quota", "rebuild", "--period", "2026-13"])


async def test_a_running_requests_reservation_is_restored_after_a_restart(
    stack: Stack, sessions: Sessions, engine_client: InProcessEngineClient
) -> None:
    """A stream far longer than the test (the client hangs up once it has seen the
    reservation come back), so it is running across the restart on any machine."""
    tenant = await _tenant(sessions, 10**12)
    prompt_tokens = len(engine_client.encode(PROMPT))
    max_tokens = engine_client.max_model_len - prompt_tokens - 8  # a long one: n=4 of them
    body = {"model": engine_client.model_name, "prompt": PROMPT, "max_tokens": max_tokens}
    body |= {"n": 4, "ignore_eos": True, "stream": True}
    worst = DEFAULT_PRICE.cost_micros(prompt_tokens, 0, 4 * max_tokens)

    async def reserved() -> bool:
        return (await _usage(stack, tenant)).reserved_micros == worst

    headers = {"Authorization": f"Bearer {tenant.secret}"}
    async with (
        httpx.AsyncClient(base_url=stack.url, timeout=120) as http,
        http.stream("POST", "/v1/completions", json=body, headers=headers) as response,
    ):
        lines = response.aiter_lines()
        assert (await anext(lines)).startswith("data: {")  # streaming
        await eventually(reserved, timeout_s=30)
        await stack.redis.restart()
        await eventually(reserved, timeout_s=5)  # the gateway's next renewal gave it back
        # The store was emptied (the admission left no trace in the window); the lease is back.
        assert (await _usage(stack, tenant)).requests_in_window == 0
        assert "[DONE]" not in await anext(lines)  # still running: the client hangs up now

    async def settled() -> bool:
        usage, ledger = await _usage(stack, tenant), await _ledger(sessions, tenant)
        return usage.reserved_micros == 0 and usage.spent_micros == ledger > 0

    await eventually(settled, timeout_s=10)
