"""The reconciler charges ledger rows whose settle never happened, exactly once."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import timedelta

import pytest
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.admission.reconcile import reconcile
from tenants.models import UsageEvent, utcnow
from tenants.quota import QuotaStore, month_period, open_quota_store
from tenants.services import ApiKeyService, TenantService, UsageService

Sessions = async_sessionmaker[AsyncSession]


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[QuotaStore]:
    url = "redis://127.0.0.1:6379/0" if request.param == "redis" else None
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
    usage = await store.usage(f"tenant:{tenant.id}", month_period())
    assert usage.spent_micros == 1000
    assert (await store.usage(f"key:{key.id}", month_period())).spent_micros == 1000
