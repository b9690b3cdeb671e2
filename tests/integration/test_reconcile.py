"""The reconciler charges ledger rows whose settle never happened, exactly once, and a
rebuild sets spend from the ledger for the whole period."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import timedelta

import pytest
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.admission.reconcile import (
    Rebuilder,
    period_bounds,
    previous_period,
    rebuild,
    reconcile,
)
from tenants.models import UsageEvent, utcnow
from tenants.quota import (
    MemoryQuotaStore,
    QuotaStore,
    key_scope,
    month_period,
    open_quota_store,
    tenant_scope,
)
from tenants.services import ApiKeyService, TenantService, UsageService
from tests.conftest import REDIS_URL

Sessions = async_sessionmaker[AsyncSession]


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[QuotaStore]:
    url = REDIS_URL if request.param == "redis" else None
    quota = open_quota_store(url, prefix=f"tg-test-{uuid.uuid4().hex[:8]}:")
    yield quota
    await quota.aclose()


async def test_unsettled_rows_are_charged_once(sessions: Sessions, store: QuotaStore) -> None:
    async with sessions.begin() as session:
        tenant = await TenantService(session).create("acme")
        key = (await ApiKeyService(session).create(tenant)).key
        for cost in (700, 300, 0):
            await UsageService(session).record(
                UsageEvent(
                    request_id=f"req_{uuid.uuid4().hex}",
                    tenant_id=tenant.id,
                    api_key_id=key.id,
                    model="m",
                    endpoint="completions",
                    status="completed",
                    cost_micros=cost,
                )
            )
    window = {"since": utcnow() - timedelta(minutes=5), "until": utcnow() + timedelta(minutes=5)}
    assert await reconcile(sessions, store, **window) == 2  # the zero-cost row needs nothing
    assert await reconcile(sessions, store, **window) == 0  # idempotent
    usage = await store.usage(tenant_scope(tenant.id), month_period())
    assert usage.spent_micros == 1000
    assert (await store.usage(key_scope(key.id), month_period())).spent_micros == 1000


async def _row(sessions: Sessions, cost: int, age: timedelta) -> tuple[str, str]:
    async with sessions.begin() as session:
        tenant = await TenantService(session).create(f"t{uuid.uuid4().hex[:8]}")
        key = (await ApiKeyService(session).create(tenant)).key
        await UsageService(session).record(
            UsageEvent(
                request_id=f"req_{uuid.uuid4().hex}",
                tenant_id=tenant.id,
                api_key_id=key.id,
                model="m",
                endpoint="completions",
                status="completed",
                cost_micros=cost,
                created_at=max(period_bounds(month_period())[0], utcnow() - age),
            )
        )
    return tenant.id, key.id


async def test_a_rebuild_covers_the_whole_period(sessions: Sessions, store: QuotaStore) -> None:
    old_tenant, old_key = await _row(sessions, 700, timedelta(hours=3))  # beyond any hour
    new_tenant, _ = await _row(sessions, 300, timedelta(seconds=1))  # inside the grace
    rebuilt = await rebuild(sessions, store)
    assert (rebuilt.ready, rebuilt.charged) == (True, 1)
    period = month_period()
    assert (await store.usage(tenant_scope(old_tenant), period)).spent_micros == 700
    assert (await store.usage(key_scope(old_key), period)).spent_micros == 700
    assert (await store.usage(tenant_scope(new_tenant), period)).spent_micros == 300
    again = await rebuild(sessions, store)  # the periodic run: nothing counted twice
    assert again.charged == 0
    assert (await store.usage(tenant_scope(new_tenant), period)).spent_micros == 300


async def test_only_a_store_that_lost_its_state_holds_admission(sessions: Sessions) -> None:
    store = MemoryQuotaStore(guarded=True)
    rebuilder = Rebuilder(sessions, store, lease_s=30, max_life_s=600)
    period = month_period()
    assert not await rebuilder._wiped(period)  # a first start: no request ended lately
    await _row(sessions, 100, timedelta(seconds=1))
    assert await rebuilder._wiped(period)  # requests ended lately, nothing known
    previous = previous_period(period)
    assert await store.finish_rebuild(previous, await store.begin_rebuild(previous), 0)
    assert not await rebuilder._wiped(period)  # a new month: last month is still known


def test_periods() -> None:
    assert previous_period("2026-01") == "2025-12"
    assert previous_period("2026-07") == "2026-06"
    start, end = period_bounds("2026-12")
    assert (start.isoformat(), end.isoformat()) == (
        "2026-12-01T00:00:00+00:00",
        "2027-01-01T00:00:00+00:00",
    )
