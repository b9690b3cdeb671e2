"""On PostgreSQL a gateway keeps the key generation in memory from LISTEN/NOTIFY instead
of reading it per request; a revocation still refuses the next request once notified,
and while the listener's connection is down every request reads the generation."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import pytest
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.admission.key_generation import APPLICATION_NAME, GenerationListener
from gateway.cli import commands as cli
from gateway.dispatch.engine_client import InProcessEngineClient
from gateway.settings import Settings
from tenants.models import KeyRole
from tenants.services import ApiKeyService, TenantService
from tests.support.gateways import Gateway, gateway, terminate_connections, until

pytestmark = pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)

Sessions = async_sessionmaker[AsyncSession]


def _listener(served: Gateway) -> GenerationListener:
    listener = served.runtime.generations
    assert listener is not None
    return listener


async def _beyond(listener: GenerationListener, generation: int | None) -> None:
    """Until the listener has taken a generation newer than `generation`."""
    assert generation is not None
    await until(listener, lambda now: now is not None and now > generation)


@contextlib.contextmanager
def _generation_reads(served: Gateway) -> Iterator[list[object]]:
    """Every checkout of the pool the per-request generation read uses."""
    pool = served.runtime.direct.sync_engine.pool
    checkouts: list[object] = []

    def note(*args: object) -> None:
        checkouts.append(args)

    event.listen(pool, "checkout", note)
    try:
        yield checkouts
    finally:
        event.remove(pool, "checkout", note)


async def _another_key(sessions: Sessions) -> str:
    async with sessions.begin() as session:
        tenant = await TenantService(session).create("other")
        return (await ApiKeyService(session).create(tenant, "k", KeyRole.TENANT)).secret


async def _kill_listener_connection(sessions: Sessions) -> None:
    assert await terminate_connections(sessions, APPLICATION_NAME) == 1


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
    async with gateway(settings, engine_client) as served:
        listener = _listener(served)
        assert await served.status(tenant_key) == 200  # looked up, remembered
        with _generation_reads(served) as reads:
            assert [await served.status(tenant_key) for _ in range(3)] == [200] * 3
            before = listener.current()
            revoke = ["keys", "revoke", tenant_key.split("_")[0]]
            assert await asyncio.to_thread(cli.main, revoke) == 0
            await _beyond(listener, before)
            assert await served.status(tenant_key) == 401
        assert reads == []


async def test_a_revocation_while_the_listener_is_down_is_honoured(
    settings: Settings, engine_client: InProcessEngineClient, tenant_key: str, sessions: Sessions
) -> None:
    async with gateway(settings, engine_client) as served:
        listener = _listener(served)
        assert await served.status(tenant_key) == 200
        listener.retry_s = 3600.0  # down for the whole test
        await _kill_listener_connection(sessions)
        await until(listener, lambda generation: generation is None)
        with _generation_reads(served) as reads:
            assert await served.status(tenant_key) == 200  # still authenticated
            async with sessions.begin() as session:
                await ApiKeyService(session).revoke(tenant_key.split("_")[0])
            assert await served.status(tenant_key) == 401
        assert len(reads) == 2  # each request read the generation itself


async def test_the_listener_listens_again_after_its_connection_is_killed(
    settings: Settings, engine_client: InProcessEngineClient, tenant_key: str, sessions: Sessions
) -> None:
    other = await _another_key(sessions)
    async with gateway(settings, engine_client) as served:
        listener = _listener(served)
        assert await served.status(tenant_key) == 200
        assert await served.status(other) == 200
        listener.retry_s = 0.05
        await _kill_listener_connection(sessions)
        await until(listener, lambda generation: generation is None)
        async with sessions.begin() as session:  # missed while down: read on listening again
            await ApiKeyService(session).revoke(tenant_key.split("_")[0])
        await until(listener, lambda generation: generation is not None)
        with _generation_reads(served) as reads:
            assert await served.status(tenant_key) == 401
            assert await served.status(other) == 200
            before = listener.current()
            async with sessions.begin() as session:
                await ApiKeyService(session).revoke(other.split("_")[0])
            await _beyond(listener, before)
            assert await served.status(other) == 401
        assert reads == []


async def test_a_revocation_committed_by_this_gateway_is_known_the_moment_it_commits(
    settings: Settings, engine_client: InProcessEngineClient, tenant_key: str
) -> None:
    """A replica's own changes do not wait for their notification: the listener holds the
    new generation as the commit returns (read here inside the commit, where no
    notification can have been taken yet), so that replica's next request is refused;
    a bump rolled back is never learnt."""
    async with gateway(settings, engine_client) as served:
        listener = _listener(served)
        sessions = served.runtime.sessions
        assert await served.status(tenant_key) == 200
        before = listener.current()
        assert before is not None
        async with sessions() as session:
            await ApiKeyService(session).revoke(tenant_key.split("_")[0])
            await session.rollback()
        assert listener.current() == before
        seen_at_commit: list[int | None] = []
        async with sessions.begin() as session:
            event.listen(session.sync_session, "after_commit", lambda _: seen_at_commit.append(
                listener.current()
            ))  # fmt: skip
            await ApiKeyService(session).revoke(tenant_key.split("_")[0])
        assert seen_at_commit == [before + 1]
        assert await served.status(tenant_key) == 401
