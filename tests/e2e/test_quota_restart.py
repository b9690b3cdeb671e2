"""Stack mode: two gateway processes on PostgreSQL and a Redis of the test's own; Redis
restarts (empty) just after a reconcile, with the tenant's earlier spend hours old. No
request is admitted past the budget, and the store ends equal to the ledger."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from datetime import timedelta
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from gateway.admission.reconcile import period_bounds, rebuild
from tenants import db, keys
from tenants.limits import LimitSet, PlanTerms
from tenants.models import UsageEvent, utcnow
from tenants.pricing import DEFAULT_PRICE
from tenants.quota import RedisQuotaStore, month_period, tenant_scope
from tenants.services import ApiKeyService, PlanService, TenantService, UsageService
from tests.conftest import POSTGRES_URL, eventually, migrated_postgres
from tests.e2e.processes import free_port, running, start
from tests.support.redis_server import redis_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPT = "Return the"
MAX_TOKENS = 8
LEASE_S = 4  # admission resumes LEASE_S / 2 after the store lost its state


async def test_redis_restart_under_two_gateways_never_overspends() -> None:
    migrated_postgres()
    engine = db.create_engine(POSTGRES_URL)
    sessions = db.session_factory(engine)
    try:
        async with redis_server() as redis:
            admin_key, _ = keys.generate_key()
            env = {
                "TOLLGATE_DATABASE_URL": POSTGRES_URL,
                "TOLLGATE_REDIS_URL": redis.url,
                "TOLLGATE_MODEL": os.environ.get("TOLLGATE_TEST_MODEL", ""),
                "TOLLGATE_ADMIN_KEY": admin_key,
                "TOLLGATE_LEASE_S": str(LEASE_S),
            }
            ports = [free_port(), free_port()]
            gateways = [start(["serve", "--port", str(port)], env) for port in ports]
            with running(*gateways):
                banners = [gateway.wait_for('"model"') for gateway in gateways]
                banner = banners[0]
                model = banner.split('"model": "')[1].split('"')[0]
                urls = [f"http://127.0.0.1:{port}" for port in ports]
                await _scenario(sessions, redis, urls, model)
    finally:
        await engine.dispose()


async def _scenario(sessions: Any, redis: Any, urls: list[str], model: str) -> None:
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    async with httpx.AsyncClient(timeout=60) as http:
        _, _, unlimited = await _tenant(sessions, None)  # to learn the prompt's tokens
        probe = await http.post(
            f"{urls[0]}/v1/completions",
            json=body,
            headers={"Authorization": f"Bearer {unlimited}"},
        )
    worst = DEFAULT_PRICE.cost_micros(probe.json()["usage"]["prompt_tokens"], 0, MAX_TOKENS)
    budget = 20 * worst
    tenant_id, key_id, secret = await _tenant(sessions, budget)
    await _old_spend(sessions, tenant_id, key_id, 10 * worst)  # half of it, hours ago
    headers = {"Authorization": f"Bearer {secret}"}

    async def wave(count: int) -> list[int]:
        async with httpx.AsyncClient(timeout=60) as http:
            responses = await asyncio.gather(
                *(
                    http.post(f"{urls[i % 2]}/v1/completions", json=body, headers=headers)
                    for i in range(count)
                )
            )
        return [r.status_code for r in responses]

    assert await wave(4) == [200] * 4
    store = RedisQuotaStore.from_url(redis.url)
    try:
        assert (await rebuild(sessions, store)).ready  # a reconcile has just run ...
    finally:
        await store.aclose()
    await redis.restart()  # ... and Redis comes back empty
    restarted = time.monotonic()
    codes: list[int] = []
    resumed: list[float] = []

    async def budget_used_up() -> bool:
        codes.extend(await wave(10))
        if 200 in codes and not resumed:
            resumed.append(time.monotonic() - restarted)
        return 429 in codes

    await eventually(budget_used_up, timeout_s=60)
    assert set(codes) <= {200, 429, 503}, codes
    ledger = await _ledger(sessions, tenant_id)
    print(
        f"\ntwo gateways, after the restart: {codes.count(200)} admitted, "
        f"{codes.count(503)} refused while rebuilding (admission resumed "
        f"{resumed[0]:.2f} s after it), {codes.count(429)} over budget; "
        f"ledger {ledger} of a budget of {budget}"
    )
    assert ledger <= budget

    async def store_equals_ledger() -> bool:
        store = RedisQuotaStore.from_url(redis.url)
        try:
            usage = await store.usage(tenant_scope(tenant_id), month_period())
        finally:
            await store.aclose()
        return usage.reserved_micros == 0 and usage.spent_micros == ledger

    await eventually(store_equals_ledger, timeout_s=3 * LEASE_S)


async def _tenant(sessions: Any, budget: int | None) -> tuple[str, str, str]:
    name = f"t{uuid.uuid4().hex[:12]}"
    async with sessions.begin() as session:
        limits = LimitSet(monthly_budget_micros=budget)
        await PlanService(session).create(name, PlanTerms(limits=limits))
        await TenantService(session).create(name)
        tenant = await TenantService(session).set_plan(name, name)
        created = await ApiKeyService(session).create(tenant)
        return tenant.id, created.key.id, created.secret


async def _old_spend(sessions: Any, tenant_id: str, key_id: str, cost: int) -> None:
    start, _ = period_bounds(month_period())
    async with sessions.begin() as session:
        await UsageService(session).record(
            UsageEvent(
                request_id=f"req_{uuid.uuid4().hex}",
                tenant_id=tenant_id,
                api_key_id=key_id,
                model="m",
                endpoint="completions",
                status="completed",
                cost_micros=cost,
                created_at=max(start + timedelta(seconds=1), utcnow() - timedelta(hours=2)),
            )
        )


async def _ledger(sessions: Any, tenant_id: str) -> int:
    async with sessions() as session:
        query = select(func.coalesce(func.sum(UsageEvent.cost_micros), 0)).where(
            UsageEvent.tenant_id == tenant_id
        )
        return int(await session.scalar(query) or 0)
