"""Settlement: every finished request writes exactly one usage_events row (and, when it
costs something, its Stripe outbox row in the same transaction), priced by the price
book version in force when the request started.

Writes run as tracked tasks so a client disconnect (which cancels the request's task)
cannot interrupt them, and shutdown waits for them: nothing metered is lost.

A gateway that dies (SIGKILL, power) writes no row for its running streams, so every
checkpoint interval (TOLLGATE_CHECKPOINT_MS, default 2 s) it records each stream's
delivered tokens in usage_checkpoints (one upsert for all of them). A new stream's first
checkpoint is written while the engine prefills it, and its first chunk waits for that
write (at most FIRST_CHECKPOINT_WAIT_S), so every stream a client saw has a row even if
the gateway dies at once. The ledger write
deletes the stream's checkpoint. A checkpoint not refreshed for STALE_AFTER_S belongs to
a dead gateway: any gateway's sweep (every ORPHAN_SWEEP_S) then writes its ledger row,
status failed, error `gateway_lost`, billed for the delivered tokens it recorded. The
bound: what a stream delivered in the last checkpoint interval before the crash, plus
during the last checkpoint write (milliseconds on an idle database), goes unbilled; the
rest is billed within STALE_AFTER_S + ORPHAN_SWEEP_S of the crash. Its reservation is
released by its lease.

The recorder's writes (ledger rows, checkpoints) go through one group commit: what is
submitted while a transaction is under way goes together in the next one, and each caller
waits for the commit holding its rows, so a settled request's row is durable before its
answer goes out, as before (never an answer without its row; the other side of that
choice: a gateway killed between the commit and the send bills an answer its client
lost with the connection). On SQLite this also means the recorder's writes never contend
with each other for the one write lock: a writer that finds it taken sleeps in SQLite's
busy handler, 100 ms at a time once it has waited 0.2 s, and under load lost the lock again
and again (up to ~2 s: issue 19's embedded p99). On SQLite a group goes through the
stdlib driver (SqliteLedger), not aiosqlite and SQLAlchemy: committed on the event loop's
own connection, then synced to disk by a thread while the answer is encoded; the answer
starts once it is on disk. On PostgreSQL a group is one pipeline on an autocommit
connection that is not pinged: one implicit transaction, one round trip, during which the
answer is encoded (it starts once the commit is done); a group whose
connection was lost is tried again on the pool that pings, unless the lost try had
committed (its rows are found under their own ids), for up to LEDGER_RETRY_S while the
database refuses connections (a restart): only then are its rows given up, each logged by
request id.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sqlite3
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any, cast

import psycopg
from sqlalchemy import Table, delete, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession, async_sessionmaker

from gateway.admission.quota import Admission
from gateway.admission.reconcile import to_us
from gateway.core.tasks import Periodic, TaskSet
from gateway.core.usage import Charge, RequestUsage
from gateway.telemetry.tracing import REQUEST_ID, in_span
from tenants.adapters import AdapterService
from tenants.billing import ledger
from tenants.billing.prices import PriceBook
from tenants.db import sqlite_pragmas
from tenants.models import UsageCheckpoint, UsageEvent, UsageStatus, as_utc, utcnow
from tenants.quota import QuotaError, key_scope, month_period, tenant_scope
from tenants.services import UsageService

log = logging.getLogger(__name__)

CHECKPOINT_S = 2.0  # how often running streams' delivered tokens are recorded (default)
FIRST_CHECKPOINT_WAIT_S = 1.0  # how long a stream's first chunk waits for its first checkpoint
STALE_AFTER_S = 15.0  # a checkpoint this old is a dead gateway's: 3x the longest interval
ORPHAN_SWEEP_S = 5.0  # how often stale checkpoints are looked for
ORPHAN_BATCH = 100
# How long a group whose connection was lost keeps trying while the database comes back
# (a restart, a failover) before its rows are given up, logged by request id.
LEDGER_RETRY_S = 10.0
LEDGER_RETRY_MAX_PAUSE_S = 1.0
SYNC_START_WAIT_S = 0.001  # how long the loop waits for the WAL's sync to start, at most


class UnsyncedCommit(Exception):
    """A group was committed but its sync to disk failed (the disk is failing): its rows
    are in the ledger but may not survive a power cut. Trying its writes again would only
    refuse them as duplicates, so each submitter hears this instead."""


class UsageRecorder:
    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        prices: PriceBook,
        tasks: TaskSet,
        admission: Admission,
        checkpoint_s: float = CHECKPOINT_S,
        direct: AsyncEngine | None = None,
        sqlite_file: str | None = None,
    ) -> None:
        self.sessions = sessions
        self.direct = direct  # PostgreSQL's autocommit pool (tenants.db): pipelined commits
        # SQLite's ledger rows on a thread and connection of their own (SqliteLedger)
        self.sqlite = SqliteLedger(sqlite_file) if sqlite_file is not None else None
        self.prices = prices
        self.tasks = tasks
        self.admission = admission
        self.checkpoint_s = checkpoint_s
        self._streams: dict[str, tuple[Charge, RequestUsage]] = {}  # running, for checkpoints
        self._checkpoints: asyncio.Task[None] | None = None
        self._writes = GroupCommit(self._commit, tasks)

    def track(self, charge: Charge, outcome: RequestUsage) -> asyncio.Task[None]:
        """A stream is under way: checkpoint its delivered tokens until it settles. Its
        first checkpoint is written at once (the task returned), so a stream can have
        its row before the client sees a byte, even if the gateway dies then."""
        self._streams[charge.request_id] = (charge, outcome)
        return self.tasks.spawn(self._first_checkpoint(charge.request_id))

    async def _first_checkpoint(self, request_id: str) -> None:
        try:
            await self.checkpoint(only={request_id})
        except Exception:  # the database briefly away: the periodic checkpoint tries again
            log.warning("first checkpoint of stream %s failed", request_id, exc_info=True)

    def settle(
        self,
        charge: Charge,
        outcome: RequestUsage,
        committed: asyncio.Future[None] | None = None,
    ) -> asyncio.Task[None]:
        """Write the row for this outcome as it is now (later changes do not leak in); the
        task ends once the row is on disk and the quota store settled. `committed` is
        resolved once the row's write is under way, so that an answer can be encoded
        meanwhile: on SQLite once it is committed, while it is synced to disk
        (SqliteLedger); on PostgreSQL once its statement is sent; else at the task's end.
        Either way the answer starts only once the task has ended well (its error is the
        task's)."""
        write = self._write(charge, replace(outcome), committed)
        task = self.tasks.spawn(in_span("settle", write, **{REQUEST_ID: charge.request_id}))
        if committed is not None:
            task.add_done_callback(lambda _: _resolve(committed, None))
        return task

    async def _event(self, charge: Charge, outcome: RequestUsage) -> UsageEvent:
        quote = await self.prices.quote(charge.model, charge.started_at, charge.base_model)
        # A request refused by the engine, or that failed on our side before sending
        # anything, costs the tenant nothing.
        free = outcome.status == UsageStatus.REJECTED or (
            outcome.status == UsageStatus.FAILED and outcome.completion_tokens == 0
        )
        price = quote.price.for_batch() if charge.batch else quote.price
        cost = price.cost_micros(
            outcome.prompt_tokens, outcome.cached_tokens, outcome.completion_tokens
        )
        return UsageEvent(
            request_id=charge.request_id,
            tenant_id=charge.principal.tenant_id,
            api_key_id=charge.principal.key_id,
            model=charge.model,
            endpoint=charge.endpoint,
            status=outcome.status,
            finish_reason=outcome.finish_reason,
            prompt_tokens=outcome.prompt_tokens,
            cached_tokens=outcome.cached_tokens,
            completion_tokens=outcome.completion_tokens,
            cost_micros=0 if free else cost,
            queue_ms=outcome.queue_ms,
            ttft_ms=outcome.ttft_ms,
            e2e_ms=outcome.e2e_ms,
            itl_ms=outcome.itl_ms,
            priority=charge.priority,
            price_version_id=quote.version_id,
            error=outcome.error,
            trace_id=outcome.trace_id,
            replica=outcome.replica,
            started_at=charge.started_at,
            created_at=utcnow(),  # the row's time, which settling passes to the store
        )

    async def _write(
        self, charge: Charge, outcome: RequestUsage, committed: asyncio.Future[None] | None
    ) -> None:
        """Ledger first, once; then quota counters from it: spent always matches the
        ledger (a crash in between leaves a row the reconciler charges later; a store
        outage, a settle the recorder retries until the store takes it)."""
        cost = tokens = 0
        at_us: int | None = None
        request_id = charge.request_id
        streamed = self._streams.pop(request_id, None) is not None
        try:
            event = await self._event(charge, outcome)
            cost = event.cost_micros
            tokens = event.prompt_tokens + event.completion_tokens
            await self._writes.submit(Settled(event, streamed, committed))
            at_us = to_us(event.created_at)
        except UnsyncedCommit:
            log.exception("usage row %s committed, but its sync to disk failed", request_id)
            at_us = to_us(event.created_at)  # in the ledger: charged as written
            raise
        except Exception:
            # Never silently: the request id lets an operator reconcile by hand.
            log.exception("usage row %s not written", request_id)
            cost = 0  # not in the ledger, so not in spent either
            raise
        finally:
            if charge.reservation is not None:
                await self.admission.settle(charge.reservation, tokens, cost, at_us)

    async def checkpoint(self, only: set[str] | None = None) -> int:
        """Record every running stream's delivered tokens, or those of the streams in
        `only` (one upsert); returns how many."""
        running = [k for k in self._streams if only is None or k in only]
        if running:
            await self._writes.submit(Checkpoint(frozenset(running)))
        return len(running)

    async def _commit(self, writes: list[Write]) -> None:
        """One transaction: the checkpoints of the streams still running, then the ledger
        rows (each deleting its stream's checkpoint)."""
        settled = [write for write in writes if isinstance(write, Settled)]
        now = utcnow()
        asked = frozenset[str]().union(*(w.streams for w in writes if isinstance(w, Checkpoint)))
        checkpoints = [
            _checkpoint_row(*self._streams[request_id], now)
            for request_id in asked
            if request_id in self._streams  # settled meanwhile: its ledger row is the record
        ]
        if not checkpoints and not settled:
            return  # the streams asked about have settled meanwhile
        if self.direct is None:  # SQLite (or a recorder given no direct pool)
            if self.sqlite is not None:
                streams = [write.event.request_id for write in settled if write.streamed]
                rows = GroupRows(checkpoints, [write.event for write in settled], streams)
                await self.sqlite.write(rows, lambda: _committed(settled))
                return
            async with self.sessions.begin() as session:
                dialect = (await session.connection()).dialect.name
                await _write_rows(session, dialect, checkpoints, settled)
            return
        # The settling requests encode their answers while the statement is on its way:
        # this runs once the write below waits for the server, its statement sent.
        asyncio.get_running_loop().call_soon(_committed, settled)
        try:
            await self._pipelined(checkpoints, settled)
        except (psycopg.OperationalError, OperationalError) as exc:
            log.warning("ledger commit lost its connection (%s): trying again", exc)
            await self._again_while_back(checkpoints, settled)

    async def _again_while_back(
        self, checkpoints: list[dict[str, Any]], settled: list[Settled]
    ) -> None:
        """`_again` until it gets through or LEDGER_RETRY_S is spent: a database that is
        restarting refuses connections for a moment, and the rows (a stream's tokens
        already delivered) must not be lost to it. The writers wait meanwhile."""
        deadline = asyncio.get_running_loop().time() + LEDGER_RETRY_S
        pause = 0.05
        while True:
            try:
                await self._again(checkpoints, settled)
                return
            except OperationalError as exc:
                if asyncio.get_running_loop().time() + pause > deadline:
                    raise
                log.warning("ledger commit: the database is unavailable (%s): retrying", exc)
            await asyncio.sleep(pause)  # a back-off while the database comes back
            pause = min(2 * pause, LEDGER_RETRY_MAX_PAUSE_S)

    async def _pipelined(self, checkpoints: list[dict[str, Any]], settled: list[Settled]) -> None:
        """PostgreSQL: the group's statements in one pipeline on an autocommit connection,
        so one implicit transaction that commits at the pipeline's Sync: one round trip;
        a group that is one statement (ledger rows alone) is sent as it is, no pipeline.
        The connection is not pinged first: one found dead, or lost on the way, fails the
        group with an OperationalError, and is dropped from the pool."""
        assert self.direct is not None
        async with self.direct.connect() as connection:
            driver = (await connection.get_raw_connection()).driver_connection
            assert isinstance(driver, psycopg.AsyncConnection)
            try:
                if _one_statement(checkpoints, settled):  # its own implicit transaction
                    await ledger.record_all_direct(driver, [write.event for write in settled])
                else:
                    async with driver.pipeline():
                        await _write_rows(connection, "postgresql", checkpoints, settled, driver)
            except (psycopg.OperationalError, OperationalError):
                if not connection.invalidated:
                    await connection.invalidate()
                raise

    async def _again(self, checkpoints: list[dict[str, Any]], settled: list[Settled]) -> None:
        """After a lost connection, on the pool that pings, in one transaction: the group
        again, unless the first try committed it (the connection may have died after its
        Sync went out). Each ledger row carries the id its event was given before the
        first try: a row of the same request under another id is not this commit's, and
        the unique request id refuses the write as it would have."""
        ids = {write.event.request_id: write.event.id for write in settled}
        async with self.sessions.begin() as session:
            if ids:
                found = await session.execute(
                    select(UsageEvent.request_id, UsageEvent.id).where(
                        UsageEvent.request_id.in_(ids)
                    )
                )
                if any(ids[request_id] == row_id for request_id, row_id in found):
                    return  # all of it, then: one transaction
            await _write_rows(session, "postgresql", checkpoints, settled)

    async def bill_orphans(self) -> int:
        """Write the ledger rows of streams whose gateway died; returns how many."""
        stale_before = utcnow() - timedelta(seconds=STALE_AFTER_S)
        async with self.sessions() as session:
            stale = (
                await session.scalars(
                    select(UsageCheckpoint)
                    .where(UsageCheckpoint.updated_at < stale_before)
                    .limit(ORPHAN_BATCH)
                )
            ).all()
            # A LoRA adapter's stream pays its base model's price (the checkpoint names
            # the adapter alone).
            bases = {a.name: a.base_model for a in await AdapterService(session).routes()}
        billed = 0
        for checkpoint in stale:
            base = bases.get(checkpoint.model)
            if checkpoint.request_id not in self._streams and await self._bill(checkpoint, base):
                billed += 1
        if billed:
            log.warning("billed %d streams of a gateway that died, from checkpoints", billed)
        return billed

    async def _bill(self, checkpoint: UsageCheckpoint, base: str | None = None) -> bool:
        """The orphan's ledger row, unless its own gateway wrote one or refreshed it (then
        it is alive), or another gateway billed it first."""
        event = await self._orphan_event(checkpoint, base)
        try:
            async with self.sessions.begin() as session:
                claimed = await session.execute(
                    delete(UsageCheckpoint).where(
                        UsageCheckpoint.request_id == checkpoint.request_id,
                        UsageCheckpoint.updated_at == checkpoint.updated_at,
                    )
                )
                if getattr(claimed, "rowcount", 0) != 1:
                    return False
                written = await session.scalar(
                    select(UsageEvent.id).where(UsageEvent.request_id == checkpoint.request_id)
                )
                if written is not None:
                    return False
                await UsageService(session).record(event)
        except IntegrityError:
            return False
        scopes = (tenant_scope(event.tenant_id), key_scope(event.api_key_id))
        try:  # now rather than at the next reconcile
            await self.admission.store.charge(
                event.request_id,
                scopes,
                month_period(event.created_at),
                event.cost_micros,
                to_us(event.created_at),
            )
        except (QuotaError, OSError):
            log.warning("orphan %s left to the reconciler", event.request_id)
        return True

    async def _orphan_event(
        self, checkpoint: UsageCheckpoint, base: str | None = None
    ) -> UsageEvent:
        started_at = as_utc(checkpoint.started_at)
        quote = await self.prices.quote(checkpoint.model, started_at, base)
        delivered = checkpoint.completion_tokens
        cost = quote.price.cost_micros(
            checkpoint.prompt_tokens, checkpoint.cached_tokens, delivered
        )
        return UsageEvent(
            request_id=checkpoint.request_id,
            tenant_id=checkpoint.tenant_id,
            api_key_id=checkpoint.api_key_id,
            model=checkpoint.model,
            endpoint=checkpoint.endpoint,
            status=UsageStatus.FAILED,
            prompt_tokens=checkpoint.prompt_tokens,
            cached_tokens=checkpoint.cached_tokens,
            completion_tokens=delivered,
            cost_micros=cost if delivered else 0,  # nothing delivered: free, as elsewhere
            priority=checkpoint.priority,
            price_version_id=quote.version_id,
            error="gateway_lost",
            trace_id=checkpoint.trace_id,
            replica=checkpoint.replica,
            started_at=started_at,
            created_at=utcnow(),
        )

    def periodic(self) -> Periodic:
        """The orphan sweep (each gateway's; idempotent). Checkpoints: start()."""
        return Periodic([(self.bill_orphans, ORPHAN_SWEEP_S)])

    def start(self) -> None:
        self._checkpoints = asyncio.get_running_loop().create_task(self._checkpoint_forever())

    async def _checkpoint_forever(self) -> None:
        """Checkpoint on a fixed schedule: a slow write does not stretch the interval."""
        loop = asyncio.get_running_loop()
        due = loop.time()
        while True:
            due = max(due + self.checkpoint_s, loop.time())
            await asyncio.sleep(due - loop.time())  # a schedule, not synchronisation
            try:
                await self.checkpoint()
            except Exception:  # the database briefly away: the next one tries again
                log.warning("checkpoint of running streams failed", exc_info=True)

    async def close(self) -> None:
        if self._checkpoints is not None:
            self._checkpoints.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._checkpoints
        if self.sqlite is not None:
            await self.sqlite.close()


@dataclass(frozen=True)
class GroupRows:
    """What one group commit writes: running streams' checkpoints (upserted), ledger rows,
    and the checkpoints of the streams those rows settle (deleted)."""

    checkpoints: list[dict[str, Any]]
    events: list[UsageEvent]
    settled_streams: list[str]


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


@dataclass(frozen=True)
class Checkpoint:
    """Record these running streams' delivered tokens."""

    streams: frozenset[str]


@dataclass(frozen=True)
class Settled:
    """A finished request's ledger row; a stream's checkpoint goes with it (only streams
    have one)."""

    event: UsageEvent
    streamed: bool
    committed: asyncio.Future[None] | None = None  # resolved once under way (settle())


Write = Settled | Checkpoint
Waiting = tuple[Write, "asyncio.Future[None]"]


class GroupCommit:
    """Writes submitted while a commit is under way wait, and go together in the next one;
    each submitter returns once the commit holding its write is done. A group that fails
    is retried write by write, so one bad write fails only its own submitter; unless it
    was committed (UnsyncedCommit): then every submitter hears that."""

    def __init__(self, commit: Callable[[list[Write]], Awaitable[None]], tasks: TaskSet) -> None:
        self.commit = commit
        self.tasks = tasks  # the committer is tracked: shutdown waits for it
        self._waiting: list[Waiting] = []
        self._committer: asyncio.Task[None] | None = None

    async def submit(self, write: Write) -> None:
        done = asyncio.get_running_loop().create_future()
        self._waiting.append((write, done))
        if self._committer is None:
            self._committer = self.tasks.spawn(self._commit_waiting())
        await asyncio.shield(done)  # a cancelled submitter does not cancel the others'

    async def _commit_waiting(self) -> None:
        group: list[Waiting] = []
        try:
            while self._waiting:
                group, self._waiting = self._waiting, []
                await self._commit_group(group)
        except BaseException as exc:  # cancelled (shutdown cut short): nobody waits forever
            for _, done in [*group, *self._waiting]:
                _resolve(done, exc)
            raise
        finally:
            self._committer = None

    async def _commit_group(self, group: list[Waiting]) -> None:
        try:
            await self.commit([write for write, _ in group])
        except Exception as exc:
            if len(group) == 1 or isinstance(exc, UnsyncedCommit):  # nothing to try again
                for _, done in group:
                    _resolve(done, exc)
                return
            for waiting in group:
                await self._commit_group([waiting])
            return
        for _, done in group:
            _resolve(done, None)


def _one_statement(checkpoints: list[dict[str, Any]], settled: list[Settled]) -> bool:
    """The group is ledger rows alone, few enough for one statement (no checkpoint to
    write, no stream's to delete)."""
    return (
        not checkpoints
        and len(settled) <= ledger.DIRECT_BATCH
        and not any(write.streamed for write in settled)
    )


def _committed(settled: list[Settled]) -> None:
    for write in settled:
        if write.committed is not None:
            _resolve(write.committed, None)


def _resolve(done: asyncio.Future[None], error: BaseException | None) -> None:
    if done.done():
        return
    if error is None:
        done.set_result(None)
    else:
        done.set_exception(error)


# What a checkpoint of a stream already checkpointed rewrites.
CHECKPOINT_CHANGES = (
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "replica",
    "updated_at",
)


def _checkpoint_upsert(insert: Callable[[type[UsageCheckpoint]], Any]) -> Any:
    """The checkpoint upsert, built once per dialect (rows are its parameters): building
    the ON CONFLICT clause per write was a measurable share of a stream's cost."""
    statement = insert(UsageCheckpoint)
    return statement.on_conflict_do_update(
        index_elements=["request_id"],
        set_={name: statement.excluded[name] for name in CHECKPOINT_CHANGES},
    )


_CHECKPOINT_UPSERTS = {
    "postgresql": _checkpoint_upsert(postgresql.insert),
    "sqlite": _checkpoint_upsert(sqlite.insert),
}


def write_sqlite_rows(connection: sqlite3.Connection, rows: GroupRows) -> None:
    """_write_rows on SQLite, straight through the stdlib driver in the caller's
    transaction: the same statements, each value bound as SQLAlchemy binds it."""
    if rows.checkpoints:
        connection.executemany(
            _SQLITE_UPSERT, [_sqlite_checkpoint(row) for row in rows.checkpoints]
        )
    if rows.events:
        ledger.record_all_sqlite(connection, rows.events)
    if rows.settled_streams:
        connection.executemany(_SQLITE_DELETE, [(stream,) for stream in rows.settled_streams])


def _sqlite_checkpoint(row: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(
        row[name] if bind is None else bind(row[name]) for name, bind in _SQLITE_CHECKPOINT_BINDS
    )


_SQLITE_DIALECT = sqlite.dialect()
_CHECKPOINTS = cast(Table, UsageCheckpoint.__table__)
# Each column's name and its bind processor for SQLite (None: the value as it is).
_SQLITE_CHECKPOINT_BINDS = [
    (column.name, column.type.dialect_impl(_SQLITE_DIALECT).bind_processor(_SQLITE_DIALECT))
    for column in _CHECKPOINTS.columns
]
_SQLITE_UPSERT = (
    'INSERT INTO "{}" ({}) VALUES ({}) ON CONFLICT ("request_id") DO UPDATE SET {}'.format(
        _CHECKPOINTS.name,
        ", ".join(f'"{name}"' for name, _ in _SQLITE_CHECKPOINT_BINDS),
        ", ".join("?" for _ in _SQLITE_CHECKPOINT_BINDS),
        ", ".join(f'"{name}" = excluded."{name}"' for name in CHECKPOINT_CHANGES),
    )
)
_SQLITE_DELETE = f'DELETE FROM "{_CHECKPOINTS.name}" WHERE "request_id" = ?'


def _checkpoint_row(charge: Charge, outcome: RequestUsage, now: datetime) -> dict[str, Any]:
    return {
        "request_id": charge.request_id,
        "tenant_id": charge.principal.tenant_id,
        "api_key_id": charge.principal.key_id,
        "model": charge.model,
        "endpoint": charge.endpoint,
        "priority": charge.priority,
        "prompt_tokens": outcome.prompt_tokens,
        "cached_tokens": outcome.cached_tokens,
        "completion_tokens": outcome.delivered,
        "trace_id": outcome.trace_id,
        "replica": outcome.replica,
        "started_at": charge.started_at,
        "updated_at": now,
    }


async def _write_rows(
    executor: AsyncSession | AsyncConnection,
    dialect: str,
    checkpoints: list[dict[str, Any]],
    settled: list[Settled],
    direct: psycopg.AsyncConnection[Any] | None = None,
) -> None:
    """A group's statements: the checkpoint upsert, the ledger rows (straight through
    psycopg on `direct`, the executor's own connection, when given), the settled streams'
    checkpoints deleted."""
    if checkpoints:
        await executor.execute(_CHECKPOINT_UPSERTS[dialect], checkpoints)
    events = [write.event for write in settled]
    if events and direct is not None:
        await ledger.record_all_direct(direct, events)
    elif events:
        await ledger.record_all(executor, events)
    streams = [write.event.request_id for write in settled if write.streamed]
    if streams:
        await executor.execute(
            delete(UsageCheckpoint).where(UsageCheckpoint.request_id.in_(streams))
        )
