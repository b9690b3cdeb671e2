"""A group commit's rows in one transaction (gateway/metering/recorder.py's GroupCommit):
running streams' checkpoints (tenants/billing/checkpoints.py), ledger rows with their
outbox rows (tenants/billing/ledger.py), and the settled streams' checkpoints deleted;
through SQLAlchemy (psycopg straight on PostgreSQL's pipeline), or on SQLite through the
stdlib driver (SqliteLedger)."""

from __future__ import annotations

import asyncio
import logging
import os
import sqlite3
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import psycopg
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from tenants.billing import checkpoints, ledger
from tenants.db import sqlite_pragmas
from tenants.models import UsageEvent, utcnow

log = logging.getLogger(__name__)

SYNC_START_WAIT_S = 0.001  # how long the loop waits for the WAL's sync to start, at most
# How long a usage row's Idempotency-Key counts (the stored answers' retention), unless
# the recorder is told (gateway/app.py: the setting).
KEY_RETENTION = timedelta(hours=24)


class UnsyncedCommit(Exception):
    """A group was committed but its sync to disk failed (the disk is failing): its rows
    are in the ledger but may not survive a power cut. Trying its writes again would only
    refuse them as duplicates, so each submitter hears this instead."""


@dataclass(frozen=True)
class GroupRows:
    """What one group commit writes: running streams' checkpoints (upserted), ledger rows,
    and the checkpoints of the streams those rows settle (deleted)."""

    checkpoints: list[dict[str, Any]]
    events: list[UsageEvent]
    settled_streams: list[str]
    # On SQLite, the rows of keys billed since then are reruns, not written (ledger.reruns):
    # write_sqlite_rows looks in its transaction, and lists them in `reruns`.
    keys_since: datetime = field(default_factory=lambda: utcnow() - KEY_RETENTION)
    reruns: list[UsageEvent] = field(default_factory=list)


async def write_rows(
    executor: AsyncSession | AsyncConnection,
    dialect: str,
    rows: GroupRows,
    direct: psycopg.AsyncConnection[Any] | None = None,
) -> None:
    """A group's statements: the checkpoint upsert, the ledger rows (straight through
    psycopg on `direct`, the executor's own connection, when given), the settled streams'
    checkpoints deleted."""
    if rows.checkpoints:
        await checkpoints.upsert(executor, dialect, rows.checkpoints)
    if rows.events and direct is not None:
        await ledger.record_all_direct(direct, rows.events)
    elif rows.events:
        await ledger.record_all(executor, rows.events)
    if rows.settled_streams:
        await checkpoints.remove(executor, rows.settled_streams)


def write_sqlite_rows(connection: sqlite3.Connection, rows: GroupRows) -> None:
    """write_rows on SQLite, straight through the stdlib driver in the caller's
    transaction: the same statements, each value bound as SQLAlchemy binds it."""
    if rows.checkpoints:
        checkpoints.upsert_sqlite(connection, rows.checkpoints)
    billed = ledger.billed_keys_sqlite(connection, rows.events, rows.keys_since)
    rows.reruns[:] = ledger.reruns(rows.events, billed)
    rerun = {id(event) for event in rows.reruns}
    events = [event for event in rows.events if id(event) not in rerun]
    if events:
        ledger.record_all_sqlite(connection, events)
    if rows.settled_streams:
        checkpoints.remove_sqlite(connection, rows.settled_streams)


class SqliteLedger:
    """A group's rows on SQLite through the stdlib driver (write_sqlite_rows), without
    SQLAlchemy's and aiosqlite's ~0.9 ms of CPU a one-row group.

    A group is committed on a connection the event loop owns, which never waits: no busy
    timeout, and `synchronous=NORMAL`, so its COMMIT appends to the WAL without syncing it.
    The write then returns once a thread of its own has synced the WAL file (fdatasync),
    which is what `synchronous=FULL` does inside COMMIT: the rows are on disk before the
    write returns, as before. The loop waits (at most SYNC_START_WAIT_S) for the thread to
    reach the sync, as the thread needs the GIL to start it; then `on_commit` lets the
    settling request encode its answer while the disk syncs. When another writer holds the
    write lock, the group goes to the thread instead, on its own connection (FULL, a 30 s
    busy timeout), which waits for the lock. The loop's connection never checkpoints (a
    checkpoint syncs the database file); the thread runs a passive one every
    CHECKPOINT_EVERY commits."""

    CHECKPOINT_EVERY = 200

    def __init__(self, path: str) -> None:
        self.path = path
        self.wal = f"{path}-wal"
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="tollgate-ledger")
        self._connection: sqlite3.Connection | None = None  # the thread's
        self._loop_connection: sqlite3.Connection | None = None  # the event loop's
        self._commits = 0  # on the loop's connection since the thread's last checkpoint
        self._wal: int | None = None  # the WAL file, opened by the thread

    async def write(self, rows: GroupRows, on_commit: Callable[[], None] | None = None) -> None:
        """The rows on disk; `on_commit` is called once they are committed on the loop's
        connection, before they are synced (not when the thread writes them)."""
        loop = asyncio.get_running_loop()
        if self._commit_on_loop(rows):
            syncing = threading.Event()
            synced = loop.run_in_executor(self._thread, self._sync, syncing)
            # Until the thread is in fdatasync (it needs the GIL to get there): the loop's
            # next work, encoding the answer, then runs while the disk syncs.
            syncing.wait(SYNC_START_WAIT_S)
            if on_commit is not None:
                on_commit()
            try:
                await synced
            except OSError as exc:
                raise UnsyncedCommit(f"the ledger's WAL could not be synced: {exc}") from exc
        else:
            await loop.run_in_executor(self._thread, self._write, rows)

    def _commit_on_loop(self, rows: GroupRows) -> bool:
        """The group committed, not yet synced; False when the write lock is taken."""
        connection = self._loop_connection or self._connect_loop()
        try:
            connection.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError:  # locked by another writer: the thread waits
            return False
        _commit_begun(connection, rows)
        return True

    def _sync(self, syncing: threading.Event) -> None:
        """The WAL on disk, the loop's last commit with it. Its file stays open: SQLite
        deletes a WAL only when the last connection closes, and the loop's stays open."""
        if self._wal is None:
            self._wal = os.open(self.wal, os.O_RDONLY)
        syncing.set()
        os.fdatasync(self._wal)
        self._commits += 1
        if self._commits >= self.CHECKPOINT_EVERY:
            self._commits = 0
            try:  # the rows are on disk already: a failed checkpoint fails none of them
                (self._connection or self._connect()).execute("PRAGMA wal_checkpoint(PASSIVE)")
            except sqlite3.Error:
                log.warning("WAL checkpoint failed: the next one tries again", exc_info=True)

    def _write(self, rows: GroupRows) -> None:
        connection = self._connection or self._connect()
        connection.execute("BEGIN IMMEDIATE")
        _commit_begun(connection, rows)

    def _connect(self) -> sqlite3.Connection:
        self._connection = _autocommit(self.path)
        return self._connection

    def _connect_loop(self) -> sqlite3.Connection:
        connection = _autocommit(self.path)
        connection.execute("PRAGMA busy_timeout = 0")
        connection.execute("PRAGMA synchronous = NORMAL")
        connection.execute("PRAGMA wal_autocheckpoint = 0")
        self._loop_connection = connection
        return connection

    async def close(self) -> None:
        """After the writes already submitted (one thread: in order)."""
        await asyncio.get_running_loop().run_in_executor(self._thread, self._disconnect)
        self._thread.shutdown()
        if self._loop_connection is not None:
            self._loop_connection.close()
            self._loop_connection = None

    def _disconnect(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None
        if self._wal is not None:
            os.close(self._wal)
            self._wal = None


def _autocommit(path: str) -> sqlite3.Connection:
    """A connection with the engine's PRAGMAs whose transactions are its user's own BEGIN
    ... COMMIT; used by one thread at a time (closed at shutdown, maybe on another)."""
    connection = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    sqlite_pragmas(connection)
    return connection


def _commit_begun(connection: sqlite3.Connection, rows: GroupRows) -> None:
    """The rows and COMMIT in the transaction begun on `connection`; ROLLBACK on failure."""
    try:
        write_sqlite_rows(connection, rows)
        connection.execute("COMMIT")
    except BaseException:
        connection.execute("ROLLBACK")
        raise
