"""The usage ledger: one row per request with its outbox row in the same transaction;
daily rollups equal the ledger."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from typing import Any

import pytest
from litestar.testing import AsyncTestClient
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError

from gateway.dispatch.engine_client import InProcessEngineClient
from tenants.billing.models import DailyUsage, OutboxRow, OutboxStatus
from tenants.billing.rollups import rebuild_days
from tenants.models import UsageEvent, UsageStatus
from tenants.services import UsageService
from tests.integration.billing_support import Sessions, ledger_rows, owner


async def test_a_request_writes_one_ledger_row_and_its_outbox_row(
    client: AsyncTestClient[Any], sessions: Sessions, engine_client: InProcessEngineClient
) -> None:
    acme = await owner(sessions, "acme")
    body = {"model": engine_client.model_name, "prompt": "The", "max_tokens": 4, "priority": 2}
    response = await client.post("/v1/completions", json=body, headers=acme.headers)
    assert response.status_code == 200, response.text
    request_id = response.headers["x-request-id"]

    async with sessions() as session:
        event = await session.scalar(select(UsageEvent).where(UsageEvent.request_id == request_id))
        assert event is not None
        outbox = list(await session.scalars(select(OutboxRow)))
    usage = response.json()["usage"]
    assert (event.tenant_id, event.api_key_id) == (acme.tenant_id, acme.key_id)
    assert event.status == UsageStatus.COMPLETED and event.priority == 2
    assert event.prompt_tokens == usage["prompt_tokens"]
    assert event.completion_tokens == usage["completion_tokens"] == 4
    assert event.finish_reason == "length"
    assert event.ttft_ms is not None and event.e2e_ms is not None and event.queue_ms is not None
    assert event.itl_ms is not None and 0 <= event.itl_ms <= event.e2e_ms
    assert event.started_at is not None and event.started_at <= event.created_at
    assert [(o.usage_event_id, o.value, o.status) for o in outbox] == [
        (event.id, event.cost_micros, OutboxStatus.PENDING)
    ]


async def test_a_failed_ledger_write_leaves_no_outbox_row(sessions: Sessions) -> None:
    acme = await owner(sessions, "acme")
    [first] = await ledger_rows(sessions, acme, [datetime.now(UTC)])
    duplicate = UsageEvent(
        request_id=first.request_id,  # the ledger refuses a second row for one request
        tenant_id=acme.tenant_id,
        api_key_id=acme.key_id,
        model="tiny",
        endpoint="completions",
        status=UsageStatus.COMPLETED,
        cost_micros=123,
    )
    with pytest.raises(IntegrityError):
        async with sessions.begin() as session:
            await UsageService(session).record(duplicate)
    async with sessions() as session:
        assert await session.scalar(select(func.count()).select_from(UsageEvent)) == 1
        outbox = await session.scalar(select(func.count()).select_from(OutboxRow))
    assert outbox == (1 if first.cost_micros else 0)


async def test_free_rows_are_not_queued_for_stripe(sessions: Sessions) -> None:
    acme = await owner(sessions, "acme")
    rows = await ledger_rows(sessions, acme, [datetime.now(UTC)] * 30, seed=8)
    async with sessions() as session:
        queued = set(await session.scalars(select(OutboxRow.usage_event_id)))
    assert queued == {row.id for row in rows if row.cost_micros > 0}
    assert len(queued) < len(rows)  # the seed makes some free rows


async def test_daily_rollups_equal_the_ledger_and_rebuild_idempotently(
    sessions: Sessions,
) -> None:
    acme = await owner(sessions, "acme")
    globex = await owner(sessions, "globex")
    start = datetime(2026, 11, 1, 20, tzinfo=UTC)
    steps = [start + timedelta(hours=3 * i) for i in range(24)]  # three UTC days
    rows = await ledger_rows(sessions, acme, steps, seed=1)
    rows += await ledger_rows(sessions, globex, steps[:5], seed=2)

    for _ in range(2):  # a rebuild replaces, never adds
        async with sessions.begin() as session:
            await rebuild_days(session, date(2026, 11, 1), date(2026, 11, 4))
    async with sessions() as session:
        rollups = list(await session.scalars(select(DailyUsage)))

    expected: dict[tuple[date, str, str], list[int]] = {}
    for row in rows:
        key = (row.created_at.astimezone(UTC).date(), row.tenant_id, row.model)
        sums = expected.setdefault(key, [0, 0, 0, 0, 0])
        for index, value in enumerate(
            (1, row.prompt_tokens, row.cached_tokens, row.completion_tokens, row.cost_micros)
        ):
            sums[index] += value
    assert {
        (r.day, r.tenant_id, r.model): [
            r.requests,
            r.prompt_tokens,
            r.cached_tokens,
            r.completion_tokens,
            r.cost_micros,
        ]
        for r in rollups
    } == expected
