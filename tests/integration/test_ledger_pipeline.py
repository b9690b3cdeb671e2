"""On PostgreSQL the recorder commits a group in one pipeline (one implicit transaction, one
round trip) on connections it does not ping: a bad write still fails alone, a dead
connection costs no row, and a commit whose outcome was lost is not written twice."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
import pytest
from litestar.testing import AsyncTestClient
from sqlalchemy import func, select, text
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.dispatch.engine_client import InProcessEngineClient
from gateway.metering import recorder as metering
from gateway.metering.recorder import Settled, UsageRecorder, Write
from gateway.runtime import Runtime
from tenants.billing import ledger
from tenants.billing.models import OutboxRow
from tenants.db import DIRECT_APPLICATION_NAME, create_direct_engine
from tenants.models import UsageEvent, UsageStatus
from tests.integration.billing_support import Owner, Sessions, owner
from tests.support.gateways import terminate_connections

pytestmark = pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)

REFUSED = (IntegrityError, psycopg.errors.IntegrityError)  # through SQLAlchemy, or the pipeline


def _recorder(client: AsyncTestClient[Any]) -> UsageRecorder:
    runtime: Runtime = client.app.state.runtime
    assert runtime.recorder.direct is not None  # pipelined on PostgreSQL
    return runtime.recorder


def _event(who: Owner, request_id: str, tenant_id: str | None = None) -> UsageEvent:
    return UsageEvent(
        request_id=request_id,
        tenant_id=tenant_id or who.tenant_id,
        api_key_id=who.key_id,
        model="tiny",
        endpoint="chat.completions",
        status=UsageStatus.COMPLETED,
        prompt_tokens=3,
        completion_tokens=4,
        cost_micros=70,
    )


async def _written(sessions: Sessions) -> list[tuple[str, int]]:
    """(request id, outbox rows) of every ledger row."""
    async with sessions() as session:
        rows = await session.execute(
            select(UsageEvent.request_id, func.count(OutboxRow.id))
            .outerjoin(OutboxRow, OutboxRow.usage_event_id == UsageEvent.id)
            .group_by(UsageEvent.request_id)
            .order_by(UsageEvent.request_id)
        )
        return [(request_id, outbox) for request_id, outbox in rows]


async def _kill_direct_connections(sessions: Sessions) -> int:
    """As a database restart does to them (tenants.db.create_direct_engine's pool)."""
    return await terminate_connections(sessions, DIRECT_APPLICATION_NAME)


async def test_a_bad_write_in_a_pipelined_group_fails_only_its_submitter(
    client: AsyncTestClient[Any], sessions: Sessions
) -> None:
    acme = await owner(sessions, "acme")
    recorder = _recorder(client)
    groups: list[int] = []
    commit: Callable[[list[Write]], Awaitable[None]] = recorder._writes.commit

    async def counted(writes: list[Write]) -> None:
        groups.append(len(writes))
        await commit(writes)

    recorder._writes.commit = counted
    events = [
        _event(acme, "req_good"),
        _event(acme, "req_bad", tenant_id="no-such-tenant"),  # its foreign key refuses it
        _event(acme, "req_fine"),
    ]
    results = await asyncio.gather(
        *(recorder._writes.submit(Settled(event, False)) for event in events),
        return_exceptions=True,
    )
    assert groups == [3, 1, 1, 1]  # together first (all rolled back), then one by one
    assert results[0] is None and results[2] is None
    assert isinstance(results[1], REFUSED)
    assert await _written(sessions) == [("req_fine", 1), ("req_good", 1)]


async def test_a_group_of_ledger_rows_alone_is_one_statement_with_its_outbox_rows(
    client: AsyncTestClient[Any], sessions: Sessions
) -> None:
    """Non-streamed rows go in one INSERT with their outbox rows (a data-modifying WITH),
    outside a pipeline: every row, and an outbox row for the billed ones only; a group
    larger than DIRECT_BATCH is several statements, all or nothing."""
    acme = await owner(sessions, "acme")
    recorder = _recorder(client)
    billed = [_event(acme, f"req_billed_{i}") for i in range(3)]
    free = _event(acme, "req_free")
    free.cost_micros = 0
    group = [billed[0], free, *billed[1:]]
    assert metering._one_statement([], [Settled(event, False) for event in group])
    await recorder._commit([Settled(event, False) for event in group])
    assert await _written(sessions) == [
        ("req_billed_0", 1), ("req_billed_1", 1), ("req_billed_2", 1), ("req_free", 0),
    ]  # fmt: skip

    many = [_event(acme, f"req_many_{i}") for i in range(5)]
    many[4].tenant_id = "no-such-tenant"  # the last statement's foreign key refuses it
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ledger, "DIRECT_BATCH", 2)
        assert not metering._one_statement([], [Settled(event, False) for event in many])
        with pytest.raises(REFUSED):
            await recorder._commit([Settled(event, False) for event in many])
    assert [request_id for request_id, _ in await _written(sessions)] == [
        "req_billed_0", "req_billed_1", "req_billed_2", "req_free",
    ]  # fmt: skip


async def test_a_row_under_way_lets_its_answer_be_encoded_and_the_write_still_ends_it(
    client: AsyncTestClient[Any], sessions: Sessions
) -> None:
    """`committed` resolves once the row's statement is sent, so the settling request
    encodes its answer while the database commits; the write itself (which the answer
    waits for: UsageRecorder.settle) ends only with the commit. A lock held by another
    transaction keeps the insert waiting meanwhile."""
    acme = await owner(sessions, "acme")
    recorder = _recorder(client)
    committed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    async with sessions() as blocker:
        await blocker.execute(text("LOCK TABLE usage_events IN EXCLUSIVE MODE"))
        write = asyncio.ensure_future(
            recorder._writes.submit(Settled(_event(acme, "req_held"), False, committed))
        )
        await asyncio.wait_for(asyncio.shield(committed), 10)
        done, _ = await asyncio.wait({write}, timeout=0.2)  # a bound: it must not end
        assert not done
        await blocker.rollback()
    await asyncio.wait_for(write, 10)
    assert await _written(sessions) == [("req_held", 1)]


async def test_requests_are_billed_after_the_direct_pools_connections_die(
    client: AsyncTestClient[Any],
    sessions: Sessions,
    engine_client: InProcessEngineClient,
    caplog: pytest.LogCaptureFixture,
) -> None:
    acme = await owner(sessions, "acme")
    body = {"model": engine_client.model_name, "prompt": "The", "max_tokens": 2}
    ids, killed = [], []
    with caplog.at_level(logging.WARNING, logger="gateway.metering.recorder"):
        for stream in (False, True, False, False):
            killed.append(await _kill_direct_connections(sessions))  # those pooled now
            response = await client.post(
                "/v1/completions", json={**body, "stream": stream}, headers=acme.headers
            )
            assert response.status_code == 200, response.text
            ids.append(response.headers["x-request-id"])
    async with sessions() as session:
        written = list(await session.scalars(select(UsageEvent.request_id)))
        checkpoints = await session.scalar(text("SELECT count(*) FROM usage_checkpoints"))
    assert sorted(written) == sorted(ids)
    assert checkpoints == 0  # the stream's went with its ledger row
    lost = [r for r in caplog.records if "lost its connection" in r.getMessage()]
    assert sum(killed) >= 2 and len(lost) == sum(killed)  # each dead one found by a write


async def test_a_commit_whose_outcome_was_lost_is_not_written_twice(
    client: AsyncTestClient[Any], sessions: Sessions
) -> None:
    """The rows went in, then the connection died before the answer came back: the try
    again finds them under the ids they were given, and writes nothing; a row of the same
    request under another id is not this commit's, and is refused as before."""
    acme = await owner(sessions, "acme")
    recorder = _recorder(client)
    mine = [_event(acme, f"req_{uuid.uuid4().hex}") for _ in range(2)]
    group: list[Write] = [Settled(event, False) for event in mine]
    await recorder._commit(group)
    assert await _kill_direct_connections(sessions) == 1  # the pooled connection is dead now
    await recorder._commit(group)  # as after a lost answer: the same rows, the same ids
    assert await _written(sessions) == sorted((event.request_id, 1) for event in mine)
    await recorder._commit([Settled(_event(acme, "req_another"), False)])
    assert await _kill_direct_connections(sessions) == 1
    someone_elses = _event(acme, mine[0].request_id)
    with pytest.raises(REFUSED):
        await recorder._commit([Settled(someone_elses, False)])


def _row(model: Any, varying: set[str]) -> dict[str, Any]:
    """A model's column values, but for those that differ between any two rows."""
    names = [c.key for c in model.__mapper__.column_attrs if c.key not in varying]
    return {name: getattr(model, name) for name in names}


async def _write_direct(engine: AsyncEngine, event: UsageEvent) -> None:
    """As gateway.metering.recorder's pipeline writes it."""
    async with engine.connect() as connection:
        driver = (await connection.get_raw_connection()).driver_connection
        assert isinstance(driver, psycopg.AsyncConnection)
        async with driver.pipeline():
            await ledger.record_all_direct(driver, [event])


async def _read_back(sessions: Sessions, request_id: str) -> tuple[UsageEvent, OutboxRow | None]:
    async with sessions() as session:
        row = await session.scalar(select(UsageEvent).where(UsageEvent.request_id == request_id))
        assert row is not None
        outbox = await session.scalar(select(OutboxRow).where(OutboxRow.usage_event_id == row.id))
    return row, outbox


async def test_the_direct_ledger_insert_writes_what_sqlalchemys_does(sessions: Sessions) -> None:
    """record_all_direct (psycopg, the pipeline's) against record_all (SQLAlchemy Core)."""
    engine = create_direct_engine(sessions.kw["bind"].url.render_as_string(hide_password=False))
    try:
        await writes_what_sqlalchemy_does(sessions, lambda event: _write_direct(engine, event))
    finally:
        await engine.dispose()


async def writes_what_sqlalchemy_does(
    sessions: Sessions, write: Callable[[UsageEvent], Awaitable[None]]
) -> None:
    """`write` against record_all (SQLAlchemy Core): the same columns read back, defaults
    filled in alike, whether a row gives few columns or all of them, with its outbox row
    where it costs something."""
    acme = await owner(sessions, "acme")
    given = {"queue_ms": 1.5, "ttft_ms": 2.5, "e2e_ms": 3.5, "itl_ms": 0.5, "priority": 2,
             "finish_reason": "length", "trace_id": "ab" * 16, "replica": "http://r",
             "error": None, "price_version_id": None}  # fmt: skip
    shapes: dict[str, dict[str, Any]] = {"few": {}, "all": given, "free": {"cost_micros": 0}}
    for shape, extra in shapes.items():
        core, other = (_event(acme, f"req_{shape}_{way}") for way in ("core", "other"))
        for event in (core, other):
            for name, value in extra.items():
                setattr(event, name, value)
        async with sessions.begin() as session:
            await ledger.record_all(session, [core])
        await write(other)
        (core_row, core_outbox), (row, outbox) = [
            await _read_back(sessions, e.request_id) for e in (core, other)
        ]
        varying = {"id", "request_id", "created_at"}
        assert _row(core_row, varying) == _row(row, varying), shape
        assert row.created_at is not None and row.id
        assert row.created_at.tzinfo == core_row.created_at.tzinfo
        assert (core_outbox is None) == (outbox is None) == (shape == "free")
        if core_outbox is not None and outbox is not None:
            varying = {"id", "usage_event_id", "created_at", "occurred_at"}
            assert _row(core_outbox, varying) == _row(outbox, varying)
            assert outbox.created_at is not None and outbox.occurred_at == row.created_at


class Restarting:
    """The recorder's pinging pool while the database restarts: its first `refusals`
    transactions fail to connect, as a server not yet accepting connections does."""

    def __init__(self, sessions: Sessions, refusals: int) -> None:
        self.sessions = sessions
        self.refusals = refusals
        self.refused = 0

    def __call__(self) -> Any:
        return self.sessions()

    def begin(self) -> Any:
        if self.refused < self.refusals:
            self.refused += 1
            refused = psycopg.OperationalError("connection refused")
            raise OperationalError("connect", {}, refused)
        return self.sessions.begin()


async def test_a_group_waits_for_a_restarting_database_instead_of_losing_its_rows(
    client: AsyncTestClient[Any], sessions: Sessions, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pipelined try finds its connection dead and the database then refuses two
    connections: the rows still go in once it answers; refused for longer than
    LEDGER_RETRY_S, the submitter gets the error (and the row is logged as lost)."""
    acme = await owner(sessions, "acme")
    recorder = _recorder(client)
    real = recorder.sessions
    assert await _kill_direct_connections(sessions) == 0  # none pooled yet: make one
    await recorder._commit([Settled(_event(acme, "req_before"), False)])
    assert await _kill_direct_connections(sessions) == 1
    restarting = Restarting(real, refusals=2)
    recorder.sessions = restarting  # type: ignore[assignment]
    await recorder._writes.submit(Settled(_event(acme, "req_during"), False))
    assert restarting.refused == 2
    assert await _written(sessions) == [("req_before", 1), ("req_during", 1)]

    monkeypatch.setattr(metering, "LEDGER_RETRY_S", 0.3)
    recorder.sessions = real
    await recorder._commit([Settled(_event(acme, "req_after"), False)])  # pools one again
    assert await _kill_direct_connections(sessions) == 1
    recorder.sessions = Restarting(real, refusals=10**6)  # type: ignore[assignment]
    with pytest.raises(OperationalError):
        await recorder._writes.submit(Settled(_event(acme, "req_lost"), False))
    recorder.sessions = real
    assert [request_id for request_id, _ in await _written(sessions)] == [
        "req_after",
        "req_before",
        "req_during",
    ]
