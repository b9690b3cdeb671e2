"""Idempotency-Key: replay, 409 in flight, 422 on another body, 400 malformed; the model
runs once however many times a request is sent."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
from litestar import Litestar
from litestar.testing import AsyncTestClient
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.app import create_app
from gateway.dispatch.engine_client import InProcessEngineClient
from gateway.settings import Settings
from tenants.idempotency import IdempotencyService
from tenants.models import IdempotencyRecord, UsageEvent, utcnow
from tests.conftest import REDIS_URL

Sessions = async_sessionmaker[AsyncSession]


@pytest.fixture(params=["memory-locks", "redis-locks"])
async def client(
    request: pytest.FixtureRequest, settings: Settings, engine_client: InProcessEngineClient
) -> AsyncIterator[AsyncTestClient[Litestar]]:
    redis_url = REDIS_URL if request.param == "redis-locks" else None
    app = create_app(replace(settings, redis_url=redis_url), engine_client=engine_client)
    async with AsyncTestClient(app=app) as test_client:
        yield test_client


def _body(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "prompt": "Return the", "max_tokens": 8, "temperature": 0, **extra}


async def _rows(sessions: Sessions) -> int:
    async with sessions() as session:
        return int(await session.scalar(select(func.count()).select_from(UsageEvent)) or 0)


async def test_repeat_replays_without_running_again(
    client: AsyncTestClient[Any],
    tenant_key: str,
    sessions: Sessions,
    engine_client: InProcessEngineClient,
) -> None:
    headers = {"Authorization": f"Bearer {tenant_key}", "Idempotency-Key": "order-1"}
    body = _body(engine_client.model_name, temperature=1.0)  # sampled: a rerun would differ
    first = await client.post("/v1/completions", json=body, headers=headers)
    steps = engine_client.engine.stats().num_steps
    again = await client.post("/v1/completions", json=body, headers=headers)
    assert first.status_code == again.status_code == 200
    assert again.content == first.content
    assert again.headers["idempotent-replayed"] == "true"
    assert again.headers["x-request-id"] == first.headers["x-request-id"]
    assert engine_client.engine.stats().num_steps == steps  # the model did not run
    assert await _rows(sessions) == 1


async def test_streams_replay_their_event_sequence(
    client: AsyncTestClient[Any],
    tenant_key: str,
    sessions: Sessions,
    engine_client: InProcessEngineClient,
) -> None:
    headers = {"Authorization": f"Bearer {tenant_key}", "Idempotency-Key": '"stream-1"'}
    body = _body(engine_client.model_name, stream=True, temperature=1.0)
    first = await client.post("/v1/completions", json=body, headers=headers)
    again = await client.post("/v1/completions", json=body, headers=headers)
    assert first.text.endswith("data: [DONE]\n\n")
    assert again.text == first.text
    assert again.headers["content-type"].startswith("text/event-stream")
    assert await _rows(sessions) == 1


async def test_same_key_other_body_is_422(
    client: AsyncTestClient[Any], tenant_key: str, engine_client: InProcessEngineClient
) -> None:
    headers = {"Authorization": f"Bearer {tenant_key}", "Idempotency-Key": "k"}
    model = engine_client.model_name
    assert (await client.post("/v1/completions", json=_body(model), headers=headers)).is_success
    other = await client.post("/v1/completions", json=_body(model, max_tokens=3), headers=headers)
    assert other.status_code == 422
    assert other.json()["error"]["code"] == "idempotency_key_reused"
    # The same body spelled differently is the same request.
    reordered = dict(reversed(list(_body(model).items())))
    assert (await client.post("/v1/completions", json=reordered, headers=headers)).is_success


@pytest.mark.parametrize("key", ["", "x" * 256, "has space", "tab\there", 'a"b'])
async def test_malformed_key_is_400(
    client: AsyncTestClient[Any], tenant_key: str, engine_client: InProcessEngineClient, key: str
) -> None:
    response = await client.post(
        "/v1/completions",
        json=_body(engine_client.model_name),
        headers={"Authorization": f"Bearer {tenant_key}", "Idempotency-Key": key},
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "Idempotency-Key"


async def test_concurrent_repeats_run_the_model_once(
    client: AsyncTestClient[Any],
    tenant_key: str,
    sessions: Sessions,
    engine_client: InProcessEngineClient,
) -> None:
    headers = {"Authorization": f"Bearer {tenant_key}", "Idempotency-Key": "burst"}
    body = _body(engine_client.model_name, max_tokens=16)
    responses = await asyncio.gather(
        *(client.post("/v1/completions", json=body, headers=headers) for _ in range(50))
    )
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) <= {200, 409}
    originals = [
        r for r in responses if r.status_code == 200 and "idempotent-replayed" not in r.headers
    ]
    assert len(originals) == 1
    replays = [r for r in responses if "idempotent-replayed" in r.headers]
    assert all(r.content == originals[0].content for r in replays)
    assert all(r.headers.get("retry-after") for r in responses if r.status_code == 409)
    assert await _rows(sessions) == 1


async def test_keys_are_scoped_per_tenant(
    client: AsyncTestClient[Any], sessions: Sessions, engine_client: InProcessEngineClient
) -> None:
    from tenants.services import ApiKeyService, TenantService

    secrets = []
    async with sessions.begin() as session:
        for name in ("one", "two"):
            tenant = await TenantService(session).create(name)
            secrets.append((await ApiKeyService(session).create(tenant)).secret)
    body = _body(engine_client.model_name)
    for secret in secrets:
        headers = {"Authorization": f"Bearer {secret}", "Idempotency-Key": "shared"}
        response = await client.post("/v1/completions", json=body, headers=headers)
        assert "idempotent-replayed" not in response.headers
    assert await _rows(sessions) == 2


async def test_expired_records_are_cleaned_up(
    client: AsyncTestClient[Any],
    tenant_key: str,
    sessions: Sessions,
    engine_client: InProcessEngineClient,
) -> None:
    headers = {"Authorization": f"Bearer {tenant_key}", "Idempotency-Key": "old"}
    await client.post("/v1/completions", json=_body(engine_client.model_name), headers=headers)
    async with sessions.begin() as session:
        assert await IdempotencyService(session).delete_expired() == 0
        later = utcnow() + timedelta(hours=25)
        assert await IdempotencyService(session).delete_expired(later) == 1
        assert await session.scalar(select(func.count()).select_from(IdempotencyRecord)) == 0
