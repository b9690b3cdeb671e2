"""The settlement of one generation: however it ends, exactly one ledger row."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from litestar.testing import AsyncTestClient
from sqlalchemy import select

from backend import SamplingParams
from gateway.api.formats import CHAT_FORMAT
from gateway.api.generation import Generation, Settlement
from gateway.core.errors import Overloaded
from gateway.core.usage import Charge
from gateway.dispatch.engine_client import InProcessEngineClient
from gateway.runtime import Runtime
from tenants.models import UsageEvent, UsageStatus
from tenants.services import ApiKeyService
from tests.integration.billing_support import Sessions, owner


async def _settlement(
    client: AsyncTestClient[Any], sessions: Sessions, engine: InProcessEngineClient
) -> Settlement:
    acme = await owner(sessions, "acme")
    async with sessions() as session:
        principal = await ApiKeyService(session).authenticate(acme.secret)
    assert principal is not None
    charge = Charge("req_settlement", principal, engine.model_name, "chat.completions")
    gen = Generation(charge, CHAT_FORMAT, [1, 2, 3], SamplingParams(max_tokens=8))
    runtime: Runtime = client.app.state.runtime
    return Settlement(gen, engine, runtime.recorder)


async def _rows(sessions: Sessions) -> list[UsageEvent]:
    async with sessions() as session:
        query = select(UsageEvent).where(UsageEvent.request_id == "req_settlement")
        return list(await session.scalars(query))


async def test_settling_twice_writes_one_row(
    client: AsyncTestClient[Any],
    sessions: Sessions,
    engine_client: InProcessEngineClient,
    caplog: pytest.LogCaptureFixture,
) -> None:
    settlement = await _settlement(client, sessions, engine_client)
    settlement.usage.completion_tokens = 5
    first = settlement.settle()
    settlement.usage.completion_tokens = 7  # too late: the row was settled
    assert settlement.settle() is first
    assert settlement.fail(Overloaded("late")).status == 503  # nor does a late failure
    await first
    with caplog.at_level(logging.ERROR):
        [row] = await _rows(sessions)
    assert (row.status, row.completion_tokens) == (UsageStatus.COMPLETED, 5)
    assert not [r for r in caplog.records if "not written" in r.getMessage()]


async def test_leaving_unsettled_settles_as_cancelled_with_what_was_delivered(
    client: AsyncTestClient[Any], sessions: Sessions, engine_client: InProcessEngineClient
) -> None:
    settlement = await _settlement(client, sessions, engine_client)

    async def client_leaves() -> None:
        async with settlement:
            settlement.usage.completion_tokens = 9  # generated ...
            settlement.usage.delivered = 4  # ... of which the client received 4
            raise asyncio.CancelledError  # the request's task is cancelled

    with pytest.raises(asyncio.CancelledError):
        await client_leaves()
    assert settlement.settled
    await settlement.settle()
    [row] = await _rows(sessions)
    assert (row.status, row.completion_tokens) == (UsageStatus.CANCELLED, 4)


async def test_a_failure_settles_once_and_the_exit_adds_nothing(
    client: AsyncTestClient[Any], sessions: Sessions, engine_client: InProcessEngineClient
) -> None:
    settlement = await _settlement(client, sessions, engine_client)
    async with settlement:
        error = settlement.fail(ValueError("a defect"))
    assert (error.status, error.code) == (500, "internal_error")
    await settlement.settle()
    [row] = await _rows(sessions)
    assert (row.status, row.error, row.completion_tokens) == (
        UsageStatus.FAILED,
        "internal_error",
        0,
    )
