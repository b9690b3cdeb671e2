"""Settlement: every finished request writes exactly one usage_events row (and, when it
costs something, its Stripe outbox row in the same transaction), priced by the price
book version in force when the request started.

A request with an Idempotency-Key (a batch line's too) is billed once per key: its row
carries the key, and a request run again because the first run's answer was lost (the
process died between the ledger commit and storing the answer) finds the key billed in
the commit's transaction: it writes no row, settles its reservation at zero and is logged
as a rerun (tenants.billing.ledger.reruns). A dead gateway's stream is billed from its
checkpoint unless its key's rerun was billed first.

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
import sqlite3
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

import psycopg
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from gateway.admission.quota import Admission
from gateway.admission.reconcile import to_us
from gateway.core.group_commit import GroupCommit, resolve
from gateway.core.tasks import Periodic, TaskSet
from gateway.core.usage import Charge, RequestUsage
from gateway.telemetry.tracing import REQUEST_ID, in_span
from tenants.adapters import AdapterService
from tenants.billing import checkpoints, ledger
from tenants.billing.ledger_writes import (
    KEY_RETENTION,
    GroupRows,
    SqliteLedger,
    UnsyncedCommit,
    write_rows,
)
from tenants.billing.prices import PriceBook
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
# A write refused by a constraint: through SQLAlchemy, the pipeline (psycopg), SqliteLedger.
REFUSED = (IntegrityError, psycopg.IntegrityError, sqlite3.IntegrityError)


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
        key_retention: timedelta = KEY_RETENTION,
    ) -> None:
        self.sessions = sessions
        self.direct = direct  # PostgreSQL's autocommit pool (tenants.db): pipelined commits
        # SQLite's ledger rows on a thread and connection of their own (SqliteLedger)
        self.sqlite = SqliteLedger(sqlite_file) if sqlite_file is not None else None
        self.prices = prices
        self.tasks = tasks
        self.admission = admission
        self.checkpoint_s = checkpoint_s
        # A usage row's Idempotency-Key counts this long (the stored answers' retention):
        # a key reused later is a new request, billed.
        self.key_retention = key_retention
        self._streams: dict[str, tuple[Charge, RequestUsage]] = {}  # running, for checkpoints
        self._checkpoints: asyncio.Task[None] | None = None
        self._writes = GroupCommit[Write](self._commit, tasks, final=(UnsyncedCommit,))

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
            task.add_done_callback(lambda _: resolve(committed, None))
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
            idempotency_key=charge.idempotency_key,
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
            write = Settled(event, streamed, committed)
            await self._submit(write)
            if write.rerun:
                cost = tokens = 0  # its key was billed by the first run: not billed again
                _log_rerun(event)
            else:
                at_us = to_us(event.created_at)
        except UnsyncedCommit:
            log.exception("usage row %s committed, but its sync to disk failed", request_id)
            if write.rerun:
                cost = tokens = 0
            else:
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

    async def _submit(self, write: Settled) -> None:
        """The row through the group commit. A keyed row refused by the unique index raced
        another run of its key past the look-up (its in-flight lock expired): once more,
        its look-up finds that run's row, and it is a rerun."""
        try:
            await self._writes.submit(write)
        except REFUSED:
            if write.event.idempotency_key is None:
                raise
            await self._writes.submit(write)

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
                await self._write_sqlite(checkpoints, settled)
                return
            async with self.sessions.begin() as session:
                dialect = (await session.connection()).dialect.name
                await _mark_billed(session, settled, self._keys_since())
                await write_rows(session, dialect, _rows(checkpoints, settled))
            return
        # The settling requests encode their answers while the statement is on its way:
        # this runs once the write below waits for the server, its statement sent.
        asyncio.get_running_loop().call_soon(_committed, settled)
        try:
            await self._pipelined(checkpoints, settled)
        except (psycopg.OperationalError, OperationalError) as exc:
            log.warning("ledger commit lost its connection (%s): trying again", exc)
            await self._again_while_back(checkpoints, settled)

    async def _write_sqlite(
        self, checkpoints: list[dict[str, Any]], settled: list[Settled]
    ) -> None:
        """SqliteLedger's group: the reruns are found in its transaction (write_sqlite_rows)."""
        assert self.sqlite is not None
        streams = [write.event.request_id for write in settled if write.streamed]
        events = [write.event for write in settled]
        rows = GroupRows(checkpoints, events, streams, self._keys_since())
        try:
            await self.sqlite.write(rows, lambda: _committed(settled))
        finally:  # committed, its sync failed (UnsyncedCommit): marked all the same
            _mark_reruns(settled, rows.reruns)

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
                # Keyed rows cost a look-up first (a round trip): is their key billed?
                events = [write.event for write in settled]
                billed = await ledger.billed_keys_direct(driver, events, self._keys_since())
                _mark_reruns(settled, ledger.reruns(events, billed))
                if _one_statement(checkpoints, settled):  # its own implicit transaction
                    await ledger.record_all_direct(driver, _first_runs(settled))
                else:
                    async with driver.pipeline():
                        rows = _rows(checkpoints, settled)
                        await write_rows(connection, "postgresql", rows, driver)
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
                found = await ledger.row_ids(session, ids)
                if any(ids[request_id] == row_id for request_id, row_id in found.items()):
                    return  # all of it, then: one transaction
            await _mark_billed(session, settled, self._keys_since())
            await write_rows(session, "postgresql", _rows(checkpoints, settled))

    def _keys_since(self) -> datetime:
        """Usage rows created since then hold their Idempotency-Keys (key_retention)."""
        return utcnow() - self.key_retention

    async def bill_orphans(self) -> int:
        """Write the ledger rows of streams whose gateway died; returns how many."""
        stale_before = utcnow() - timedelta(seconds=STALE_AFTER_S)
        async with self.sessions() as session:
            stale = await checkpoints.stale(session, stale_before, ORPHAN_BATCH)
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
                if not await checkpoints.claim(session, checkpoint):
                    return False
                if await ledger.row_ids(session, [checkpoint.request_id]):
                    return False
                billed = await ledger.billed_keys(session, [event], self._keys_since())
                if ledger.reruns([event], billed):
                    _log_rerun(event)  # its key's rerun was billed: the checkpoint goes
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
            idempotency_key=checkpoint.idempotency_key,
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
class Checkpoint:
    """Record these running streams' delivered tokens."""

    streams: frozenset[str]


@dataclass
class Settled:
    """A finished request's ledger row; a stream's checkpoint goes with it (only streams
    have one)."""

    event: UsageEvent
    streamed: bool
    committed: asyncio.Future[None] | None = None  # resolved once under way (settle())
    # Set by the commit: its Idempotency-Key was billed already (the first run's answer
    # was lost), so no row was written (tenants.billing.ledger.reruns).
    rerun: bool = False


Write = Settled | Checkpoint


def _rows(checkpoints: list[dict[str, Any]], settled: list[Settled]) -> GroupRows:
    """The group's rows, once its reruns are marked: theirs are not written."""
    streams = [write.event.request_id for write in settled if write.streamed]
    return GroupRows(checkpoints, _first_runs(settled), streams)


async def _mark_billed(session: AsyncSession, settled: list[Settled], since: datetime) -> None:
    """Mark the reruns among `settled`, looked up in the session's transaction."""
    events = [write.event for write in settled]
    billed = await ledger.billed_keys(session, events, since)
    _mark_reruns(settled, ledger.reruns(events, billed))


def _mark_reruns(settled: list[Settled], reruns: list[UsageEvent]) -> None:
    rerun = {id(event) for event in reruns}
    for write in settled:
        write.rerun = id(write.event) in rerun


def _first_runs(settled: list[Settled]) -> list[UsageEvent]:
    """The rows to write: all but the reruns'."""
    return [write.event for write in settled if not write.rerun]


def _log_rerun(event: UsageEvent) -> None:
    """A request run again under a key already billed: not billed again, but recorded."""
    log.warning(
        "request %s reran the Idempotency-Key of a billed request: not billed again",
        event.request_id,
        extra={
            "request_id": event.request_id,
            "tenant_id": event.tenant_id,
            "idempotency_rerun": True,
        },
    )


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
            resolve(write.committed, None)


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
        "idempotency_key": charge.idempotency_key,
    }
