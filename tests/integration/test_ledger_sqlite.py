"""On SQLite the recorder writes a group of ledger rows through the stdlib driver
(tenants.billing.ledger_writes.SqliteLedger): committed on the event loop's connection and
synced on a thread, or on the thread alone while another writer holds the lock. The rows are those
SQLAlchemy writes, a bad write still fails alone, and the WAL is checkpointed."""

from __future__ import annotations

import asyncio
import errno
import os
import sqlite3
import threading
from datetime import datetime, timedelta
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from gateway.app import create_app
from gateway.dispatch.engine_client import InProcessEngineClient
from gateway.metering.recorder import Settled, UsageRecorder
from gateway.settings import Settings
from tenants.billing import checkpoints, ledger
from tenants.billing.ledger_writes import GroupRows, SqliteLedger, UnsyncedCommit
from tenants.db import sqlite_path
from tenants.models import UsageCheckpoint, UsageEvent, as_utc, utcnow
from tests.conftest import eventually, serving
from tests.integration.billing_support import Owner, Sessions, owner
from tests.integration.test_ledger_pipeline import _event, writes_what_sqlalchemy_does

pytestmark = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)


def _file(sessions: Sessions) -> str:
    path = sqlite_path(sessions.kw["bind"].url.render_as_string(hide_password=False))
    assert path is not None
    return path


async def test_the_sqlite_ledger_insert_writes_what_sqlalchemys_does(sessions: Sessions) -> None:
    """record_all_sqlite (the stdlib driver, SQLAlchemy's bind processors) against
    record_all (SQLAlchemy Core)."""
    writer = SqliteLedger(_file(sessions))
    try:
        await writes_what_sqlalchemy_does(
            sessions, lambda event: writer.write(GroupRows([], [event], []))
        )
    finally:
        await writer.close()


async def test_a_group_with_a_bad_row_writes_the_others(sessions: Sessions, client: Any) -> None:
    """The gateway's recorder on SQLite takes the stdlib path; a duplicate request id in a
    group fails its own submitter only (the group is retried write by write)."""
    recorder: UsageRecorder = client.app.state.runtime.recorder
    assert recorder.sqlite is not None and recorder.direct is None
    acme = await owner(sessions, "acme")
    async with sessions.begin() as session:
        await ledger.record_all(session, [_event(acme, "req_taken")])
    writes = [Settled(_event(acme, rid), streamed=False) for rid in ("req_a", "req_taken", "req_b")]
    results = await asyncio.gather(
        *(recorder._writes.submit(write) for write in writes), return_exceptions=True
    )
    assert results[0] is None and results[2] is None
    assert isinstance(results[1], sqlite3.IntegrityError)
    async with sessions() as session:
        written = await session.scalars(
            select(UsageEvent.request_id).order_by(UsageEvent.request_id)
        )
        assert list(written) == ["req_a", "req_b", "req_taken"]


async def test_a_group_whose_sync_fails_is_not_written_again(
    sessions: Sessions, client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group committed on the loop whose WAL sync then fails (EIO: the disk failing):
    every submitter hears UnsyncedCommit, each row is in the ledger once, and none is
    tried again as a duplicate. Once the disk syncs again, so do the next groups."""
    recorder: UsageRecorder = client.app.state.runtime.recorder
    assert recorder.sqlite is not None
    acme = await owner(sessions, "acme")

    def failing(_: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    with monkeypatch.context() as patch:
        patch.setattr(os, "fdatasync", failing)
        writes = [Settled(_event(acme, rid), streamed=False) for rid in ("req_a", "req_b")]
        results = await asyncio.gather(
            *(recorder._writes.submit(write) for write in writes), return_exceptions=True
        )
    assert all(isinstance(result, UnsyncedCommit) for result in results), results
    await recorder._writes.submit(Settled(_event(acme, "req_c"), streamed=False))
    async with sessions() as session:
        written = await session.scalars(
            select(UsageEvent.request_id).order_by(UsageEvent.request_id)
        )
        assert list(written) == ["req_a", "req_b", "req_c"]


async def test_a_group_waits_on_the_thread_while_another_writer_holds_the_lock(
    sessions: Sessions,
) -> None:
    """The loop's connection does not wait for the write lock: the thread's does, and the
    write ends once the other writer commits."""
    acme = await owner(sessions, "acme")
    writer = SqliteLedger(_file(sessions))
    other = sqlite3.connect(_file(sessions), isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        write = asyncio.ensure_future(writer.write(GroupRows([], [_event(acme, "req_waits")], [])))
        done, _ = await asyncio.wait({write}, timeout=0.5)  # a bound: it must not finish
        assert not done
        other.execute("COMMIT")
        await write
        assert other.execute("SELECT count(*) FROM usage_events").fetchone() == (1,)
    finally:
        other.close()
        await writer.close()


async def test_the_wal_is_checkpointed_every_so_many_commits(sessions: Sessions) -> None:
    """The loop's connection never checkpoints; the thread does, so the WAL restarts
    instead of growing with every row."""
    acme = await owner(sessions, "acme")
    frames: dict[int, int] = {}
    for every in (5, 1000):
        writer = SqliteLedger(_file(sessions))
        writer.CHECKPOINT_EVERY = every
        try:
            for n in range(21):
                await writer.write(GroupRows([], [_event(acme, f"req_{every}_{n}")], []))
            reader = sqlite3.connect(_file(sessions))
            log = reader.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
            reader.close()
            frames[every] = log[1]  # (busy, frames in the WAL, frames checkpointed)
        finally:
            await writer.close()
    assert frames[5] * 3 < frames[1000]


def _checkpoint(who: Owner, request_id: str, delivered: int, at: datetime) -> dict[str, Any]:
    return {"request_id": request_id, "tenant_id": who.tenant_id, "api_key_id": who.key_id,
            "model": "tiny", "endpoint": "chat.completions", "priority": 1,
            "prompt_tokens": 3, "cached_tokens": 1, "completion_tokens": delivered,
            "trace_id": "ab" * 16, "replica": "http://r", "started_at": at - timedelta(seconds=1),
            "updated_at": at, "idempotency_key": "k"}  # fmt: skip


async def _checkpoint_rows(sessions: Sessions) -> dict[str, dict[str, Any]]:
    async with sessions() as session:
        found = await session.scalars(select(UsageCheckpoint))
        return {
            row.request_id: {c.key: getattr(row, c.key) for c in UsageCheckpoint.__table__.c}
            for row in found
        }


async def test_checkpoints_are_written_updated_and_deleted_as_sqlalchemy_does(
    sessions: Sessions,
) -> None:
    """The stdlib upsert against SQLAlchemy's (the ORM path's statement); a second
    checkpoint rewrites the tokens and the time only; a stream's ledger row deletes its
    checkpoint in the same group."""
    acme = await owner(sessions, "acme")
    at = utcnow()
    async with sessions.begin() as session:
        await checkpoints.upsert(session, "sqlite", [_checkpoint(acme, "req_core", 5, at)])
    writer = SqliteLedger(_file(sessions))
    try:
        await writer.write(GroupRows([_checkpoint(acme, "req_ours", 5, at)], [], []))
        rows = await _checkpoint_rows(sessions)
        assert {**rows["req_core"], "request_id": "req_ours"} == rows["req_ours"]
        assert as_utc(rows["req_ours"]["updated_at"]) == at

        later = at + timedelta(seconds=2)
        again = {**_checkpoint(acme, "req_ours", 9, later), "started_at": later, "priority": 7}
        await writer.write(GroupRows([again], [], []))
        updated = (await _checkpoint_rows(sessions))["req_ours"]
        assert as_utc(updated["updated_at"]) == later
        assert {**updated, "updated_at": None} == {
            **rows["req_ours"],
            "completion_tokens": 9,
            "updated_at": None,
        }

        await writer.write(GroupRows([], [_event(acme, "req_ours")], ["req_ours"]))
        assert set(await _checkpoint_rows(sessions)) == {"req_core"}
        async with sessions() as session:
            assert await session.scalar(
                select(UsageEvent.request_id).where(UsageEvent.request_id == "req_ours")
            )
    finally:
        await writer.close()


async def test_a_whole_answer_starts_only_once_its_row_is_synced(
    settings: Settings, tenant_key: str, engine_client: InProcessEngineClient, sessions: Sessions
) -> None:
    """The row is committed on the loop and synced by the ledger thread; the answer is
    held until the sync is done. With the thread kept busy, no answer comes."""
    app = create_app(settings, engine_client=engine_client)
    busy, release = threading.Event(), threading.Event()

    def occupy() -> None:
        busy.set()
        release.wait(30)

    body = {"model": engine_client.model_name, "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4, "ignore_eos": True}  # fmt: skip
    headers = {"Authorization": f"Bearer {tenant_key}"}
    async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
        recorder: UsageRecorder = app.state.runtime.recorder
        assert recorder.sqlite is not None
        recorder.sqlite._thread.submit(occupy)  # its next job, the sync, waits behind this
        assert busy.wait(10)
        answer = asyncio.ensure_future(
            http.post("/v1/chat/completions", json=body, headers=headers)
        )

        async def committed() -> bool:  # the row is in, not yet on disk
            async with sessions() as session:
                return await session.scalar(select(func.count()).select_from(UsageEvent)) == 1

        try:
            await eventually(committed)
            done, _ = await asyncio.wait({answer}, timeout=0.5)  # a bound: it must not come
            assert not done
        finally:
            release.set()
        response = await answer
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 4
