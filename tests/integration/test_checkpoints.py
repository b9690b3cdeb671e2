"""Streams in flight are checkpointed, and a dead gateway's checkpoints are billed once."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import timedelta

import httpx
from litestar import Litestar
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.app import create_app
from gateway.dispatch.engine_client import InProcessEngineClient
from gateway.metering.recorder import STALE_AFTER_S
from gateway.runtime import Runtime
from gateway.settings import Settings
from tenants.models import UsageCheckpoint, UsageEvent, utcnow
from tenants.pricing import DEFAULT_PRICE
from tenants.services import ApiKeyService, TenantService
from tests.conftest import eventually, serving

Sessions = async_sessionmaker[AsyncSession]


def _runtime(app: Litestar) -> Runtime:
    runtime: Runtime = app.state.runtime
    return runtime


async def _checkpoints(sessions: Sessions) -> dict[str, int]:
    async with sessions() as session:
        rows = await session.execute(
            select(UsageCheckpoint.request_id, UsageCheckpoint.completion_tokens)
        )
        return {row.request_id: row.completion_tokens for row in rows}


@contextlib.asynccontextmanager
async def _long_stream(
    app: Litestar, engine_client: InProcessEngineClient, key: str
) -> AsyncIterator[httpx.Response]:
    """A 2,000-token completion streamed from `app` served on loopback."""
    body = {"model": engine_client.model_name, "prompt": "The", "max_tokens": 2000}
    body |= {"ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {key}"}
    async with (
        serving(app) as url,
        httpx.AsyncClient(base_url=url, timeout=60) as http,
        http.stream("POST", "/v1/completions", json=body, headers=headers) as response,
    ):
        yield response


async def test_a_running_stream_is_checkpointed_until_it_settles(
    settings: Settings,
    engine_client: InProcessEngineClient,
    tenant_key: str,
    sessions: Sessions,
) -> None:
    app = create_app(settings, engine_client=engine_client)
    async with _long_stream(app, engine_client, tenant_key) as response:
        request_id = response.headers["x-request-id"]
        lines = response.aiter_lines()
        received = 0
        while received < 6:  # some tokens have reached us
            received += (await anext(lines)).startswith("data: {")
        assert await _runtime(app).recorder.checkpoint() == 1
        first = (await _checkpoints(sessions))[request_id]
        assert first >= 1
        while received < 12:
            received += (await anext(lines)).startswith("data: {")
        await _runtime(app).recorder.checkpoint()
        assert (await _checkpoints(sessions))[request_id] > first
    # The client left: the stream settled (cancelled) and its checkpoint went with it.

    async def gone() -> bool:
        return request_id not in await _checkpoints(sessions)

    await eventually(gone)


async def test_a_new_stream_is_checkpointed_at_once_not_after_an_interval(
    settings: Settings,
    engine_client: InProcessEngineClient,
    tenant_key: str,
    sessions: Sessions,
) -> None:
    """A gateway that dies in a stream's first interval must still leave its row: a new
    stream is checkpointed before its first chunk is sent, not after the 5 s interval."""
    app = create_app(replace(settings, checkpoint_ms=5000), engine_client=engine_client)
    async with _long_stream(app, engine_client, tenant_key) as response:
        request_id = response.headers["x-request-id"]
        lines = response.aiter_lines()
        while not (await anext(lines)).startswith("data: {"):
            pass
        assert request_id in await _checkpoints(sessions)  # already, with the first chunk


async def test_a_dead_gateways_checkpoint_is_billed_once(
    settings: Settings, engine_client: InProcessEngineClient, sessions: Sessions
) -> None:
    async with sessions.begin() as session:
        tenant = await TenantService(session).create(f"t{uuid.uuid4().hex[:8]}")
        key = (await ApiKeyService(session).create(tenant)).key
        now = utcnow()
        for name, age_s in (("dead", STALE_AFTER_S + 5), ("alive", 1.0)):
            session.add(
                UsageCheckpoint(
                    request_id=f"req_{name}",
                    tenant_id=tenant.id,
                    api_key_id=key.id,
                    model="m",
                    endpoint="chat.completions",
                    prompt_tokens=10,
                    cached_tokens=0,
                    completion_tokens=37,
                    started_at=now - timedelta(seconds=60),
                    updated_at=now - timedelta(seconds=age_s),
                )
            )
    app = create_app(settings, engine_client=engine_client)
    async with serving(app):
        recorder = _runtime(app).recorder
        assert await recorder.bill_orphans() == 1
        assert await recorder.bill_orphans() == 0  # billed once
    async with sessions() as session:
        rows = (await session.scalars(select(UsageEvent))).all()
    assert [(r.request_id, r.status, r.error, r.completion_tokens) for r in rows] == [
        ("req_dead", "failed", "gateway_lost", 37)
    ]
    assert rows[0].cost_micros == DEFAULT_PRICE.cost_micros(10, 0, 37)
    assert set(await _checkpoints(sessions)) == {"req_alive"}
