"""On SQLite the recorder writes a group of ledger rows through the stdlib driver, on a
thread and connection of its own (gateway.metering.SqliteLedger): the rows are those
SQLAlchemy writes, and a bad write still fails alone."""

from __future__ import annotations

import asyncio
import sqlite3
from typing import Any

import pytest
from sqlalchemy import select

from gateway.metering import Settled, SqliteLedger, UsageRecorder
from tenants.billing import ledger
from tenants.db import sqlite_path
from tenants.models import UsageEvent
from tests.integration.billing_support import Sessions, owner
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
        await writes_what_sqlalchemy_does(sessions, lambda event: writer.write([event]))
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
