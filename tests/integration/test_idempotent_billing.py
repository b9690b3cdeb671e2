"""A tenant is billed at most once per Idempotency-Key, whatever crashes: a request whose
usage row was written but whose answer was not stored (the process died between the two)
runs again on its retry, answers, and is not billed again."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
from litestar import Litestar
from litestar.testing import AsyncTestClient
from sqlalchemy import delete, func, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.app import create_app
from gateway.dispatch.engine_client import InProcessEngineClient
from gateway.metering.recorder import STALE_AFTER_S, Settled, UsageRecorder
from gateway.runtime import Runtime
from gateway.settings import Settings
from tenants import idempotency
from tenants.billing import ledger
from tenants.billing.models import OutboxRow
from tenants.models import (
    IdempotencyRecord,
    Tenant,
    UsageCheckpoint,
    UsageEvent,
    UsageStatus,
    utcnow,
)
from tenants.quota import month_period, tenant_scope
from tests.integration.billing_support import Owner, owner

Sessions = async_sessionmaker[AsyncSession]


@pytest.fixture
async def client(
    settings: Settings, engine_client: InProcessEngineClient
) -> AsyncIterator[AsyncTestClient[Litestar]]:
    app = create_app(replace(settings, redis_url=None), engine_client=engine_client)
    async with AsyncTestClient(app=app) as test_client:
        yield test_client


def _body(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "prompt": "Return the", "max_tokens": 8, "temperature": 0, **extra}


async def _ledger(sessions: Sessions) -> tuple[int, int]:
    """The usage rows and their total cost."""
    async with sessions() as session:
        rows, cost = (
            await session.execute(select(func.count(), func.sum(UsageEvent.cost_micros)))
        ).one()
    return int(rows), int(cost or 0)


async def _spent(client: AsyncTestClient[Litestar], sessions: Sessions) -> tuple[int, int]:
    """The tenant's spent and reserved budget in the quota store, once settled."""
    runtime: Runtime = client.app.state.runtime
    await runtime.tasks.drain()
    async with sessions() as session:
        tenant_id = await session.scalar(select(Tenant.id).where(Tenant.name == "acme"))
    assert tenant_id is not None
    usage = await runtime.admission.store.usage(tenant_scope(tenant_id), month_period())
    return usage.spent_micros, usage.reserved_micros


async def _lose_stored_answers(sessions: Sessions) -> None:
    """What a process killed after the ledger write, before storing the answer, leaves."""
    async with sessions.begin() as session:
        await session.execute(delete(IdempotencyRecord))


@pytest.mark.parametrize("stream", [False, True])
async def test_a_rerun_whose_answer_was_lost_is_not_billed_again(
    client: AsyncTestClient[Litestar],
    tenant_key: str,
    sessions: Sessions,
    engine_client: InProcessEngineClient,
    stream: bool,
) -> None:
    headers = {"Authorization": f"Bearer {tenant_key}", "Idempotency-Key": "order-7"}
    body = _body(engine_client.model_name, stream=stream)
    first = await client.post("/v1/completions", json=body, headers=headers)
    assert first.status_code == 200
    rows, cost = await _ledger(sessions)
    assert rows == 1 and cost > 0
    await _lose_stored_answers(sessions)
    again = await client.post("/v1/completions", json=body, headers=headers)
    assert again.status_code == 200
    assert "idempotent-replayed" not in again.headers  # it ran again: the answer was lost
    assert again.headers["x-request-id"] != first.headers["x-request-id"]
    if stream:
        assert again.text.endswith("data: [DONE]\n\n")
    else:  # greedy: the same answer
        assert again.json()["choices"] == first.json()["choices"]
    assert await _ledger(sessions) == (1, cost)  # billed once
    assert await _spent(client, sessions) == (cost, 0)  # the rerun's reservation released
    # Its answer is stored now: a third try replays it.
    third = await client.post("/v1/completions", json=body, headers=headers)
    assert third.headers["idempotent-replayed"] == "true"
    assert third.headers["x-request-id"] == again.headers["x-request-id"]


async def test_a_crash_while_storing_the_answer_bills_its_retry_once(
    client: AsyncTestClient[Litestar],
    tenant_key: str,
    sessions: Sessions,
    engine_client: InProcessEngineClient,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The store of the answer fails after the usage row is committed (as a process killed
    there would): the retry runs again and is not billed again."""

    async def crash(*_: object) -> bool:
        raise RuntimeError("killed before the answer was stored")

    headers = {"Authorization": f"Bearer {tenant_key}", "Idempotency-Key": "order-8"}
    body = _body(engine_client.model_name)
    with monkeypatch.context() as patched:
        patched.setattr(idempotency.IdempotencyService, "save", crash)
        first = await client.post("/v1/completions", json=body, headers=headers)
    assert first.status_code == 500
    rows, cost = await _ledger(sessions)
    assert rows == 1 and cost > 0
    again = await client.post("/v1/completions", json=body, headers=headers)
    assert again.status_code == 200
    assert await _ledger(sessions) == (1, cost)
    assert await _spent(client, sessions) == (cost, 0)


async def test_a_key_reused_after_its_retention_is_billed(
    client: AsyncTestClient[Litestar],
    tenant_key: str,
    sessions: Sessions,
    engine_client: InProcessEngineClient,
) -> None:
    """Past the retention of stored answers a key is free again (the IETF draft): its new
    request is billed, and the old row gives the key up."""
    headers = {"Authorization": f"Bearer {tenant_key}", "Idempotency-Key": "monthly"}
    body = _body(engine_client.model_name)
    assert (await client.post("/v1/completions", json=body, headers=headers)).is_success
    _, cost = await _ledger(sessions)
    await _lose_stored_answers(sessions)  # expired and cleaned up
    async with sessions.begin() as session:
        await session.execute(update(UsageEvent).values(created_at=utcnow() - timedelta(days=2)))
    assert (await client.post("/v1/completions", json=body, headers=headers)).is_success
    assert await _ledger(sessions) == (2, 2 * cost)
    async with sessions() as session:
        keys = (await session.scalars(select(UsageEvent.idempotency_key))).all()
    assert len(keys) == 2 and set(keys) == {None, "monthly"}


def _recorder(client: AsyncTestClient[Litestar]) -> UsageRecorder:
    runtime: Runtime = client.app.state.runtime
    return runtime.recorder


def _event(who: Owner, request_id: str, key: str | None) -> UsageEvent:
    return UsageEvent(
        request_id=request_id,
        tenant_id=who.tenant_id,
        api_key_id=who.key_id,
        model="tiny",
        endpoint="chat.completions",
        status=UsageStatus.COMPLETED,
        prompt_tokens=3,
        completion_tokens=4,
        cost_micros=70,
        idempotency_key=key,
    )


async def _written(sessions: Sessions) -> list[tuple[str, str | None, int]]:
    """(request id, key, outbox rows) of every ledger row."""
    async with sessions() as session:
        rows = await session.execute(
            select(UsageEvent.request_id, UsageEvent.idempotency_key, func.count(OutboxRow.id))
            .outerjoin(OutboxRow, OutboxRow.usage_event_id == UsageEvent.id)
            .group_by(UsageEvent.request_id, UsageEvent.idempotency_key)
            .order_by(UsageEvent.request_id)
        )
        return [(request_id, key, outbox) for request_id, key, outbox in rows]


async def test_a_group_writes_one_row_per_key_and_tenant(
    client: AsyncTestClient[Litestar], sessions: Sessions
) -> None:
    """In one group commit: a run and its rerun (the rerun's row and outbox row are not
    written), the same key of another tenant, and a row without a key."""
    acme, other = await owner(sessions, "acme"), await owner(sessions, "other")
    writes = [
        Settled(_event(acme, "req_first", "k"), streamed=False),
        Settled(_event(acme, "req_rerun", "k"), streamed=False),
        Settled(_event(other, "req_other", "k"), streamed=False),
        Settled(_event(acme, "req_plain", None), streamed=False),
    ]
    recorder = _recorder(client)
    await asyncio.gather(*(recorder._writes.submit(write) for write in writes))
    assert [write.rerun for write in writes] == [False, True, False, False]
    assert await _written(sessions) == [
        ("req_first", "k", 1),
        ("req_other", "k", 1),
        ("req_plain", None, 1),
    ]


async def test_a_rerun_that_raced_past_the_look_up_is_not_billed(
    client: AsyncTestClient[Litestar], sessions: Sessions, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two runs of a key at once (the first's in-flight lock expired): the second's look-up
    missed the first's row, so the unique index refuses its write; it looks again."""
    acme = await owner(sessions, "acme")
    recorder = _recorder(client)
    await recorder._writes.submit(Settled(_event(acme, "req_first", "k"), streamed=False))
    looked: list[int] = []
    reruns = ledger.reruns

    def missed_once(events: Any, billed: Any) -> list[UsageEvent]:
        looked.append(len(events))
        return [] if len(looked) == 1 else reruns(events, billed)

    monkeypatch.setattr(ledger, "reruns", missed_once)
    write = Settled(_event(acme, "req_second", "k"), streamed=False)
    await recorder._submit(write)
    assert looked == [1, 1] and write.rerun
    assert await _written(sessions) == [("req_first", "k", 1)]


async def test_a_dead_gateways_stream_whose_key_was_billed_is_not_billed_again(
    client: AsyncTestClient[Litestar], sessions: Sessions
) -> None:
    """The client retried the stream of a gateway that died, and its rerun was billed: the
    orphan's checkpoint is dropped, not billed."""
    acme = await owner(sessions, "acme")
    recorder = _recorder(client)
    await recorder._writes.submit(Settled(_event(acme, "req_rerun", "k"), streamed=False))
    now = utcnow()
    async with sessions.begin() as session:
        session.add(
            UsageCheckpoint(
                request_id="req_dead",
                tenant_id=acme.tenant_id,
                api_key_id=acme.key_id,
                model="m",
                endpoint="chat.completions",
                prompt_tokens=10,
                cached_tokens=0,
                completion_tokens=37,
                started_at=now - timedelta(seconds=60),
                updated_at=now - timedelta(seconds=STALE_AFTER_S + 5),
                idempotency_key="k",
            )
        )
    assert await recorder.bill_orphans() == 0
    async with sessions() as session:
        assert await session.scalar(select(func.count()).select_from(UsageCheckpoint)) == 0
    assert await _written(sessions) == [("req_rerun", "k", 1)]
