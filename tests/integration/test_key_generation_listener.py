"""On PostgreSQL a gateway keeps the key generation in memory from LISTEN/NOTIFY instead
of reading it per request; a revocation still refuses the next request once notified,
and while the listener's connection is down every request reads the generation."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import pytest
from litestar import Litestar
from litestar.testing import AsyncTestClient
from sqlalchemy import event, text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway import cli
from gateway.admission.key_generation import APPLICATION_NAME, GenerationListener
from gateway.app import create_app
from gateway.dispatch.engine_client import InProcessEngineClient
from gateway.runtime import Runtime
from gateway.settings import Settings
from tenants.models import KeyRole
from tenants.services import ApiKeyService, TenantService

pytestmark = pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)

Sessions = async_sessionmaker[AsyncSession]
Client = AsyncTestClient[Litestar]
NOTIFIED_WITHIN_S = 10.0  # a bound on a wait for an event, never a pause


@contextlib.asynccontextmanager
async def _gateway(
    settings: Settings, engine_client: InProcessEngineClient
) -> AsyncIterator[tuple[Client, GenerationListener]]:
    """A gateway whose listener is live."""
    app = create_app(settings, engine_client=engine_client)
    async with AsyncTestClient(app=app) as client:
        listener = _runtime(client).generations
        assert listener is not None
        await _until(listener, lambda generation: generation is not None)
        yield client, listener


def _runtime(client: Client) -> Runtime:
    runtime: Runtime = client.app.state.runtime
    return runtime


async def _until(listener: GenerationListener, check: Callable[[int | None], bool]) -> None:
    async with asyncio.timeout(NOTIFIED_WITHIN_S):
        await listener.until(check)


async def _beyond(listener: GenerationListener, generation: int | None) -> None:
    """Until the listener has taken a generation newer than `generation`."""
    assert generation is not None
    await _until(listener, lambda now: now is not None and now > generation)


@contextlib.contextmanager
def _generation_reads(client: Client) -> AsyncIterator[list[object]]:  # type: ignore[misc]
    """Every checkout of the pool the per-request generation read uses."""
    pool = _runtime(client).direct.sync_engine.pool
    checkouts: list[object] = []

    def note(*_: object) -> None:
        checkouts.append(_)

    event.listen(pool, "checkout", note)
    try:
        yield checkouts
    finally:
        event.remove(pool, "checkout", note)


async def _status(client: Client, secret: str) -> int:
    """The status of an authenticated request that writes no ledger row."""
    headers = {"Authorization": f"Bearer {secret}"}
    return (await client.get("/v1/models", headers=headers)).status_code


async def _another_key(sessions: Sessions) -> str:
    async with sessions.begin() as session:
        tenant = await TenantService(session).create("other")
        return (await ApiKeyService(session).create(tenant, "k", KeyRole.TENANT)).secret


async def _kill_listener_connection(sessions: Sessions) -> None:
    async with sessions() as session:
        killed = await session.scalar(
            text(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE application_name = :name"
            ),
            {"name": APPLICATION_NAME},
        )
    assert killed == 1


async def test_a_revocation_by_the_cli_refuses_the_next_request_once_notified_with_no_reads(
    settings: Settings,
    engine_client: InProcessEngineClient,
    tenant_key: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No generation read per request while the listener is live (this fails if the
    listener is ignored); `tollgate keys revoke`, another process's connection, still
    refuses the next request as soon as its notification is in."""
    monkeypatch.setenv("TOLLGATE_DATABASE_URL", settings.database_url)
    async with _gateway(settings, engine_client) as (client, listener):
        assert await _status(client, tenant_key) == 200  # looked up, remembered
        with _generation_reads(client) as reads:
            assert [await _status(client, tenant_key) for _ in range(3)] == [200] * 3
            before = listener.current()
            revoke = ["keys", "revoke", tenant_key.split("_")[0]]
            assert await asyncio.to_thread(cli.main, revoke) == 0
            await _beyond(listener, before)
            assert await _status(client, tenant_key) == 401
        assert reads == []


async def test_a_revocation_while_the_listener_is_down_is_honoured(
    settings: Settings, engine_client: InProcessEngineClient, tenant_key: str, sessions: Sessions
) -> None:
    async with _gateway(settings, engine_client) as (client, listener):
        assert await _status(client, tenant_key) == 200
        listener.retry_s = 3600.0  # down for the whole test
        await _kill_listener_connection(sessions)
        await _until(listener, lambda generation: generation is None)
        with _generation_reads(client) as reads:
            assert await _status(client, tenant_key) == 200  # still authenticated
            async with sessions.begin() as session:
                await ApiKeyService(session).revoke(tenant_key.split("_")[0])
            assert await _status(client, tenant_key) == 401
        assert len(reads) == 2  # each request read the generation itself


async def test_the_listener_listens_again_after_its_connection_is_killed(
    settings: Settings, engine_client: InProcessEngineClient, tenant_key: str, sessions: Sessions
) -> None:
    other = await _another_key(sessions)
    async with _gateway(settings, engine_client) as (client, listener):
        assert await _status(client, tenant_key) == 200
        assert await _status(client, other) == 200
        listener.retry_s = 0.05
        await _kill_listener_connection(sessions)
        await _until(listener, lambda generation: generation is None)
        async with sessions.begin() as session:  # missed while down: read on listening again
            await ApiKeyService(session).revoke(tenant_key.split("_")[0])
        await _until(listener, lambda generation: generation is not None)
        with _generation_reads(client) as reads:
            assert await _status(client, tenant_key) == 401
            assert await _status(client, other) == 200
            before = listener.current()
            async with sessions.begin() as session:
                await ApiKeyService(session).revoke(other.split("_")[0])
            await _beyond(listener, before)
            assert await _status(client, other) == 401
        assert reads == []
