"""Authenticated keys are remembered for a few seconds, yet a revocation (or any change
to a key's standing) made anywhere refuses the next request on every gateway: the very
next on SQLite, the next once notified on PostgreSQL (gateway.admission.key_generation)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import psycopg
import pytest
from psycopg.pq import TransactionStatus
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.admission.key_cache import KeyCache, key_generation
from gateway.dispatch.engine_client import InProcessEngineClient
from gateway.settings import Settings
from tenants.limits import LimitSet
from tenants.models import KeyRole
from tenants.services import ApiKeyService, Principal, TenantService
from tests.support.gateways import Gateway, gateway, notified

Sessions = async_sessionmaker[AsyncSession]


@contextlib.asynccontextmanager
async def _gateways(
    settings: Settings, engine_client: InProcessEngineClient
) -> AsyncIterator[tuple[Gateway, Gateway]]:
    """Two gateway replicas sharing one database."""
    async with gateway(settings, engine_client) as one, gateway(settings, engine_client) as other:
        yield one, other


async def _remembered(served: Gateway, secret: str) -> Principal | None:
    runtime = served.runtime
    async with runtime.db.connect() as connection:
        return runtime.keys.get(secret, await key_generation(connection))


async def _generation(sessions: Sessions) -> int | None:
    async with sessions() as session:
        return await key_generation(await session.connection())


async def _admin_key(sessions: Sessions) -> str:
    async with sessions.begin() as session:
        tenant = await TenantService(session).create("ops")
        return (await ApiKeyService(session).create(tenant, "root", KeyRole.ADMIN)).secret


def _bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


async def test_a_key_revoked_on_one_gateway_is_refused_by_another_once_notified(
    settings: Settings, engine_client: InProcessEngineClient, tenant_key: str, sessions: Sessions
) -> None:
    """At once on SQLite (read per request); on PostgreSQL once the other gateway's
    listener has the change's notification (tests/integration/test_key_generation_listener)."""
    admin = await _admin_key(sessions)
    async with _gateways(settings, engine_client) as (one, other):
        assert await other.status(tenant_key) == 200
        assert await _remembered(other, tenant_key) is not None  # the next one needs no lookup
        before = await _generation(sessions)
        prefix = tenant_key.split("_")[0]
        revoked = await one.http.post(f"/admin/api/keys/{prefix}/revoke", headers=_bearer(admin))
        assert revoked.status_code == 200
        assert await _remembered(other, tenant_key) is None
        await notified(other, before)
        assert await other.status(tenant_key) == 401


async def test_a_revocation_outside_any_gateway_is_seen_once_notified(
    settings: Settings, engine_client: InProcessEngineClient, tenant_key: str, sessions: Sessions
) -> None:
    """As `tollgate keys revoke` does it: straight in the database."""
    async with _gateways(settings, engine_client) as (one, _):
        assert await one.status(tenant_key) == 200
        before = await _generation(sessions)
        async with sessions.begin() as session:
            await ApiKeyService(session).revoke(tenant_key.split("_")[0])
        await notified(one, before)
        assert await one.status(tenant_key) == 401


async def test_new_limits_reach_a_remembered_key_once_notified(
    settings: Settings, engine_client: InProcessEngineClient, tenant_key: str, sessions: Sessions
) -> None:
    async with _gateways(settings, engine_client) as (one, _):
        assert await one.status(tenant_key) == 200
        before = await _generation(sessions)
        async with sessions.begin() as session:
            await ApiKeyService(session).set_limits(tenant_key.split("_")[0], LimitSet(rpm=7))
        await notified(one, before)
        assert await one.status(tenant_key) == 200
        remembered = await _remembered(one, tenant_key)
        assert remembered is not None and remembered.key_limits.rpm == 7


def test_a_remembered_key_is_forgotten_when_the_generation_moves_or_time_is_up() -> None:
    caller = Principal(tenant_id="t", tenant_name="acme", key_id="k", role=KeyRole.TENANT)
    cache = KeyCache()
    cache.put("tg-secret", caller, generation=3)
    assert cache.get("tg-secret", 3) == caller
    assert cache.get("tg-secret", 4) is None
    assert cache.get("tg-secret", 3) is None  # forgotten, not remembered again
    expired = KeyCache(remember_s=0.0)
    expired.put("tg-secret", caller, generation=3)
    assert expired.get("tg-secret", 3) is None
    bounded = KeyCache(most=2)
    for name in ("a", "b", "c"):
        bounded.put(name, caller, generation=1)
    assert [bounded.get(name, 1) for name in ("a", "b", "c")] == [None, caller, caller]


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
async def test_the_generation_read_outlives_a_dead_connection_and_opens_no_transaction(
    settings: Settings, engine_client: InProcessEngineClient, tenant_key: str, sessions: Sessions
) -> None:
    """The generation's pool pings nothing before use, so a connection the database
    dropped (a restart) fails its read: the read is tried once more on a new one, and a
    revocation is still seen at once. Each read is autocommit: one round trip. (The
    generation is read per request while the PostgreSQL listener is blind: closed here.)"""
    async with _gateways(settings, engine_client) as (one, _):
        listener = one.runtime.generations
        assert listener is not None
        await listener.close()
        assert await one.status(tenant_key) == 200
        reads = one.runtime.direct
        async with reads.connect() as connection:
            pid = await connection.scalar(text("SELECT pg_backend_pid()"))
            driver = (await connection.get_raw_connection()).driver_connection
            assert isinstance(driver, psycopg.AsyncConnection)
            assert driver.info.transaction_status is TransactionStatus.IDLE  # no BEGIN sent
        async with sessions() as session:  # the pooled connection dies, as in a restart
            assert await session.scalar(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        assert await one.status(tenant_key) == 200
        async with sessions.begin() as session:
            await ApiKeyService(session).revoke(tenant_key.split("_")[0])
        assert await one.status(tenant_key) == 401
