"""`create_app(settings)` alone configures an app, and its lifespan closes what it opened."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest
from litestar.testing import AsyncTestClient
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from backend.errors import CheckpointError
from gateway.app import create_app
from gateway.dispatch.engine_client import InProcessEngineClient
from gateway.runtime import Runtime
from gateway.settings import Settings
from tenants.services import ApiKeyService, TenantService
from tests.integration.test_telemetry import _chat, _metric_samples

pytestmark = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)


async def test_a_failed_startup_closes_what_it_opened(settings: Settings, tmp_path: Path) -> None:
    """The engine is the last thing startup opens: when it cannot load, the database, the
    stores and every background job opened before it are closed again."""
    app = create_app(replace(settings, model_path=tmp_path / "no-such-model"))
    before = asyncio.all_tasks()
    with pytest.raises(ExceptionGroup) as failed:  # Litestar runs startup in a task group
        async with app.lifespan():  # in this loop, so its tasks are this loop's
            pass
    assert failed.group_contains(CheckpointError, match="no-such-model")
    runtime: Runtime = app.state.runtime  # opened before the engine
    assert runtime.engine_client is None
    assert asyncio.all_tasks() - before == set()  # quota loops, upkeep, sweeps: all stopped


async def _key(sessions: async_sessionmaker[AsyncSession], tenant: str) -> str:
    async with sessions.begin() as session:
        created = await ApiKeyService(session).create(await TenantService(session).create(tenant))
    return created.secret


def _labelled(text: str) -> set[str]:
    return {
        labels["tenant"]
        for name, labels, _ in _metric_samples(text)
        if name == "tollgate_requests_total"
    }


async def test_two_apps_in_one_process_follow_their_own_settings(
    settings: Settings,
    engine_client: InProcessEngineClient,
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    """Metrics access and the tenant-label bound come from each app's own settings, not
    from the process's environment or the app built before it."""
    narrow = create_app(
        replace(settings, metrics_token="token-narrow", metrics_top_tenants=1),
        engine_client=engine_client,
    )
    wide = create_app(replace(settings, metrics_token="token-wide"), engine_client=engine_client)
    keys = [await _key(sessions, "acme"), await _key(sessions, "globex")]
    body = _chat(engine_client.model_name, "Hello")
    async with AsyncTestClient(app=narrow) as a, AsyncTestClient(app=wide) as b:
        for client in (a, b):
            for key in keys:
                headers = {"Authorization": f"Bearer {key}"}
                response = await client.post("/v1/chat/completions", json=body, headers=headers)
                assert response.status_code == 200
        assert (
            await a.get("/metrics", headers={"Authorization": "Bearer token-wide"})
        ).status_code == 401
        assert (
            await b.get("/metrics", headers={"Authorization": "Bearer token-narrow"})
        ).status_code == 401
        scraped_a = await a.get("/metrics", headers={"Authorization": "Bearer token-narrow"})
        scraped_b = await b.get("/metrics", headers={"Authorization": "Bearer token-wide"})
    assert len(_labelled(scraped_a.text) - {"other"}) == 1 and "other" in _labelled(scraped_a.text)
    assert len(_labelled(scraped_b.text)) == 2 and "other" not in _labelled(scraped_b.text)
