"""A client that goes away stops costing engine time, and is billed for what it got."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from litestar import Litestar
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.dispatch.engine_client import InProcessEngineClient
from tenants.models import UsageEvent
from tests.conftest import eventually, read_text_events

Sessions = async_sessionmaker[AsyncSession]


# Far more than the tests let it make, so a fast machine cannot finish before the client
# leaves: a request that runs to the end fails them.
MAX_TOKENS = 1000


def _payload(model: str, stream: bool) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": "Return the",
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
    }


async def _row(sessions: Sessions, request_id: str) -> UsageEvent | None:
    async with sessions() as session:
        query = select(UsageEvent).where(UsageEvent.request_id == request_id)
        return (await session.execute(query)).scalar_one_or_none()


async def _rows(sessions: Sessions) -> list[UsageEvent]:
    async with sessions() as session:
        return list((await session.execute(select(UsageEvent))).scalars())


def _engine_idle(engine_client: InProcessEngineClient) -> bool:
    stats = engine_client.engine.stats()
    return stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_blocks_used == 0


async def test_stream_disconnect_aborts_and_bills_what_was_written(
    live_server: tuple[Litestar, str],
    tenant_key: str,
    sessions: Sessions,
    engine_client: InProcessEngineClient,
) -> None:
    _, base = live_server
    async with (
        httpx.AsyncClient(base_url=base) as http,
        http.stream(
            "POST",
            "/v1/completions",
            json=_payload(engine_client.model_name, stream=True),
            headers={"Authorization": f"Bearer {tenant_key}"},
        ) as response,
    ):
        request_id = response.headers["x-request-id"]
        await read_text_events(response, 5)  # then leaving the block disconnects
    await eventually(lambda: _row(sessions, request_id))
    row = await _row(sessions, request_id)
    assert row is not None
    assert row.status == "cancelled"
    assert 5 <= row.completion_tokens < MAX_TOKENS
    await eventually(lambda: _engine_idle(engine_client))


async def test_non_streaming_disconnect_aborts_too(
    live_server: tuple[Litestar, str],
    tenant_key: str,
    sessions: Sessions,
    engine_client: InProcessEngineClient,
) -> None:
    _, base = live_server
    steps_before = engine_client.engine.stats().num_steps
    async with httpx.AsyncClient(base_url=base) as http:
        call = asyncio.create_task(
            http.post(
                "/v1/completions",
                json=_payload(engine_client.model_name, stream=False),
                headers={"Authorization": f"Bearer {tenant_key}"},
            )
        )
        await eventually(lambda: engine_client.engine.stats().num_running == 1)
        call.cancel()  # the client gives up: httpx closes the connection
        await asyncio.gather(call, return_exceptions=True)
    await eventually(lambda: _engine_idle(engine_client))
    await eventually(lambda: _rows(sessions))
    [row] = await _rows(sessions)
    assert row.status == "cancelled"
    assert row.completion_tokens == 0  # nothing was delivered
    # It stopped early: far fewer steps than the tokens it asked for.
    assert engine_client.engine.stats().num_steps - steps_before < MAX_TOKENS * 3 // 4
