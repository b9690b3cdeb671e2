"""Runs batches in the gateway's background (embedded mode), or one batch in a Celery task
(stack mode, gateway/batches/worker.py): claims lines fairly between tenants, runs
each at the batch class (gateway.batches.execute), keeps each result as it comes, expires
a batch at its window with what is done, and writes its output and error files.

A line is claimed by a conditional update and leased: a runner renews its lines' leases
while they run, so another gateway takes over a dead one's lines once the lease lapses;
an embedded gateway (SQLite, the only runner) takes its own back at start. A line's
result is kept with it; one run again (its runner died after the line was billed, before
its result was kept) is not billed again: its key is in the ledger.

Lines yield to interactive work: while the engine runs or queues any request below the
batch class, the runner starts no line (the engine would hold its rows anyway, and its
request path would take the gateway's event loop from the interactive requests); the lines
under way go on (the engine holds their outputs meanwhile: backend/engine/async_engine.py),
and new ones start once that work has drained, RAMP_LINES at a time, so that a chat
arriving meanwhile finds a few lines' request paths on the event loop, not a round's."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import defaultdict
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.batches.execute import LineRunner, Retry, batch_priority
from gateway.core.errors import AuthenticationFailed, InternalError
from gateway.core.group_commit import GroupCommit
from gateway.core.tasks import TaskSet
from gateway.dispatch.engine_client import EngineClient, InProcessEngineClient
from gateway.settings import Settings
from tenants.batches import (
    ACTIVE,
    WINDOWS,
    Batch,
    BatchLine,
    BatchQueue,
    BatchStatus,
    LineOutcome,
    LineResult,
    LineStatus,
    key_principal,
)
from tenants.blobs import BlobStore
from tenants.db import is_postgres
from tenants.files import FileStore
from tenants.models import as_utc, utcnow
from tenants.services import Principal

log = logging.getLogger(__name__)

REMOTE_SLOTS = 128  # replicas do not say their max_num_seqs: a GPU's default is 256
HELD_POLL_S = 0.02  # while lines wait for interactive work: how often the engine is read
RAMP_LINES = 4  # lines started at once; the next ones RAMP_S later, unless a chat came
RAMP_S = 0.025
LATE_SHARE = 0.5  # of a batch's window: in the rest, its lines run beside interactive work


class BatchRunner:
    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        settings: Settings,
        run_line: LineRunner,
        engine_client: EngineClient | None,
        blobs: BlobStore,
        concurrency: int | None = None,  # None: half the engine's slots (engine_slots)
        poll_s: float = 0.25,
        lease: timedelta | None = None,  # None: TOLLGATE_BATCH_LEASE_S
        drain_s: float = 30.0,
        only: str | None = None,
        held_poll_s: float = HELD_POLL_S,
        ramp_s: float = RAMP_S,
    ) -> None:
        self.sessions, self.settings, self.blobs = sessions, settings, blobs
        self.run_line = run_line
        # Lines in the engine at once, all batches together.
        self.concurrency = concurrency or engine_slots(engine_client) // 2 or 1
        self.poll_s = poll_s
        # Interactive requests in the engine now; the lines wait while there are any.
        self.interactive: Callable[[], int] = (
            engine_client.interactive_work if engine_client is not None else lambda: 0
        )
        self.held_poll_s = held_poll_s
        self.ramp_s = ramp_s  # between groups of RAMP_LINES lines started
        self.held = False  # the last round started no line: interactive work was in the engine
        self.lease = lease or timedelta(seconds=settings.batch_lease_s)
        self.drain_s = drain_s  # how long a stop waits for the lines under way
        self.only = only  # one batch (a Celery task's runner), or all of them (a gateway's)
        self.idle = asyncio.Event()  # a round found nothing to run: every batch is final
        self._running: dict[tuple[str, int], asyncio.Task[None]] = {}
        # Lines finish in bursts (started together, of like lengths): their results are
        # kept a group a transaction, not one each on the event loop.
        self._keeping = TaskSet()
        self._results = GroupCommit(self._keep, self._keeping)
        self._wakeup = asyncio.Event()
        self._turns: dict[str, int] = {}  # when each tenant and batch was last served
        self._turn = 0
        self._loop: asyncio.Task[None] | None = None
        self._renewed_at = utcnow()

    def start(self) -> None:
        self._loop = asyncio.get_running_loop().create_task(self._run(), name="batch-runner")

    def wake(self, batch_id: str | None = None) -> None:
        """A batch was created or cancelled: look now, not at the next poll."""
        self._wakeup.set()

    async def close(self) -> None:
        """Stop starting lines, let those under way finish (for `drain_s` at most), and
        hand back what is left: it runs again after the restart."""
        if self._loop is not None:
            self._loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop
        lines = dict(self._running)
        if lines:  # a line stopped halfway may be billed and still lose its answer: wait
            await asyncio.wait(lines.values(), timeout=self.drain_s)
        for task in lines.values():
            task.cancel()
        await asyncio.gather(*lines.values(), return_exceptions=True)
        await self._keeping.drain()  # results under way are kept before the rest go back
        by_batch: dict[str, list[int]] = defaultdict(list)
        for batch_id, line in lines:
            by_batch[batch_id].append(line)
        async with self.sessions.begin() as session:
            for batch_id, numbers in by_batch.items():
                await BatchQueue(session).release(batch_id, numbers)

    async def _run(self) -> None:
        if self.only is None and not is_postgres(self.settings.database_url):
            await self._take_back_all()
        while True:
            try:
                await self.round()
            except Exception:  # a database hiccup: the next round tries again
                log.exception("batch round failed")
                self.held = False  # after the poll interval, not at once
            self._wakeup.clear()
            if self.held:
                await self._until_drained()
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wakeup.wait(), self.poll_s)

    async def _until_drained(self) -> None:
        """Until the engine has no interactive work, or the next round (poll_s: leases,
        expiry and cancellations go on). The engine has no event for it: a cheap count,
        read every held_poll_s."""
        loop = asyncio.get_running_loop()
        until = loop.time() + self.poll_s
        while loop.time() < until:
            if not self.interactive():
                return
            await asyncio.sleep(self.held_poll_s)

    async def _take_back_all(self) -> None:
        async with self.sessions.begin() as session:
            queue = BatchQueue(session)
            for batch in await queue.active():
                await queue.release(batch.id)

    async def round(self) -> None:
        """One look at every active batch: renew, expire, finish, and start more lines."""
        async with self.sessions.begin() as session:
            batches = await BatchQueue(session).active(self.only)
        if not batches and not self._running:
            self.idle.set()
        await self._renew()
        startable = []
        for batch in batches:
            if await self._advance(batch):
                startable.append(batch)
        await self._start_lines(startable)

    async def _advance(self, batch: Batch) -> bool:
        """Move the batch on; True if it may start more lines."""
        now = utcnow()
        async with self.sessions.begin() as session:
            queue = BatchQueue(session)
            # Locked (PostgreSQL): of two gateways, one finalizes, the other then sees it final.
            current = await session.get(
                Batch, batch.id, populate_existing=True, with_for_update=True
            )
            if current is None or current.status not in ACTIVE:
                return False
            ending = current.status == BatchStatus.CANCELLING or now >= as_utc(current.expires_at)
            if ending:
                await queue.expire_pending(batch.id)
            if await queue.unfinished(batch.id) > 0:
                return not ending
            if ending or current.status == BatchStatus.FINALIZING:
                await self._finalize(session, current, ending)
            else:  # OpenAI's `finalizing`, seen until the next round has written the files
                current.status, current.finalizing_at = BatchStatus.FINALIZING, now
            return False

    async def _finalize(self, session: Any, batch: Batch, ending: bool) -> None:
        """Output and error files from the lines' results, then the batch's final status."""
        now = utcnow()
        lines = await BatchQueue(session).lines(batch.id)
        cancelled = batch.status == BatchStatus.CANCELLING
        outputs = [_record(batch, line, cancelled) for line in lines]
        ok = [r for r, line in zip(outputs, lines, strict=True) if line.status == "succeeded"]
        bad = [r for r, line in zip(outputs, lines, strict=True) if line.status != "succeeded"]
        files = FileStore(session, self.blobs, batch.tenant_id)
        batch.finalizing_at = batch.finalizing_at or now
        if ok:
            batch.output_file_id = (
                await files.create(f"{batch.id}_output.jsonl", "batch_output", _jsonl(ok))
            ).id
        if bad:
            batch.error_file_id = (
                await files.create(f"{batch.id}_error.jsonl", "batch_output", _jsonl(bad))
            ).id
        if cancelled:
            batch.status, batch.cancelled_at = BatchStatus.CANCELLED, now
        elif ending:
            batch.status, batch.expired_at = BatchStatus.EXPIRED, now
        else:
            batch.status, batch.completed_at = BatchStatus.COMPLETED, now

    async def _renew(self) -> None:
        now = utcnow()
        if now - self._renewed_at < self.lease / 3:
            return
        self._renewed_at = now
        by_batch: dict[str, list[int]] = defaultdict(list)
        for batch_id, line in self._running:
            by_batch[batch_id].append(line)
        async with self.sessions.begin() as session:
            for batch_id, numbers in by_batch.items():
                await BatchQueue(session).renew(batch_id, numbers)

    async def _start_lines(self, batches: list[Batch]) -> None:
        """Free slots shared between tenants equally, then between a tenant's batches;
        while interactive work is in the engine, only batches late in their window."""
        free = self.concurrency - len(self._running)
        if batches and self.interactive() > 0:
            batches = [batch for batch in batches if late(batch)]
            # Not held with nothing to start: the loop then waits for a wake-up.
            self.held = free > 0 and not batches
        else:
            self.held = False
        if free <= 0 or not batches:
            return
        by_tenant: dict[str, dict[str, Batch]] = defaultdict(dict)
        for batch in batches:
            by_tenant[batch.tenant_id][batch.id] = batch
        present = {*by_tenant, *(batch.id for batch in batches)}  # forget the finished
        self._turns = {key: turn for key, turn in self._turns.items() if key in present}
        tenants, per_tenant = self._take_turns(list(by_tenant), free)
        for tenant in tenants:
            named = by_tenant[tenant]
            chosen, per_batch = self._take_turns(list(named), per_tenant)
            for batch in (named[batch_id] for batch_id in chosen):
                async with self.sessions.begin() as session:
                    lines = await BatchQueue(session).claim(batch.id, per_batch, self.lease)
                    # Once per claim, not per line (a three-table read on the event loop):
                    # a key revoked from now on fails the lines claimed after it.
                    principal = await key_principal(session, batch.api_key_id) if lines else None
                if not await self._ramp(batch, lines, principal):
                    return

    def _take_turns(self, keys: list[str], slots: int) -> tuple[list[str], int]:
        """Of `keys` (tenants, or a tenant's batches), at most `slots`, those served
        longest ago first (the rest wait for the next round: no round starts more lines
        than it has slots), and the slots each gets."""
        chosen = sorted(keys, key=lambda key: self._turns.get(key, -1))[:slots]
        for key in chosen:
            self._turn += 1
            self._turns[key] = self._turn
        return chosen, slots // len(chosen)

    async def _ramp(
        self, batch: Batch, lines: list[BatchLine], principal: Principal | None
    ) -> bool:
        """Start the claimed lines RAMP_LINES at a time, ramp_s apart, so a chat arriving
        meanwhile finds a few lines' request paths on the event loop, not a round's; the
        rest go back to pending if one did (False: held)."""
        started, yields = 0, not late(batch)
        try:
            for started, line in enumerate(lines):
                if started and started % RAMP_LINES == 0:
                    await asyncio.sleep(self.ramp_s)
                    if yields and self.interactive():
                        self.held = True
                        return False
                key = (batch.id, line.line)
                task = asyncio.get_running_loop().create_task(self._line(batch, line, principal))
                self._running[key] = task
                task.add_done_callback(partial(self._done, key))
            started = len(lines)
            return True
        finally:
            if started < len(lines):
                rest = [line.line for line in lines[started:]]
                async with self.sessions.begin() as session:
                    await BatchQueue(session).release(batch.id, rest)

    def _done(self, key: tuple[str, int], _: asyncio.Task[None]) -> None:
        self._running.pop(key, None)
        # Claim in bulk, not line by line; held, the next look waits for _until_drained.
        if not self.held and len(self._running) <= self.concurrency // 2:
            self._wakeup.set()

    async def _line(self, batch: Batch, line: BatchLine, principal: Principal | None) -> None:
        outcome = await self._outcome(batch, line, principal)
        if outcome is None:
            async with self.sessions.begin() as session:
                await BatchQueue(session).release(batch.id, [line.line])
            return
        await self._results.submit(LineResult(batch.id, line.line, outcome))

    async def _keep(self, results: list[LineResult]) -> None:
        async with self.sessions.begin() as session:
            await BatchQueue(session).finish(results)

    async def _outcome(
        self, batch: Batch, line: BatchLine, principal: Principal | None
    ) -> LineOutcome | None:
        """The line's answer as `principal` (None: the batch's key is revoked); None: it
        could not start now, and runs later."""
        if principal is None:
            refused = AuthenticationFailed("the key that created this batch was revoked")
            return LineOutcome(refused.status, refused.body(), None)
        left = (as_utc(batch.expires_at) - utcnow()).total_seconds()
        priority = batch_priority(self.settings.engine, left)
        key = f"batch:{batch.id}:{line.line}"
        try:
            return await self.run_line(principal, batch.endpoint, line.body, key, priority)
        except Retry:
            return None
        except Exception:  # a defect: the line fails, the batch goes on
            log.exception("batch line failed")
            failed = InternalError("the line failed on the server")
            return LineOutcome(failed.status, failed.body(), None)


def late(batch: Batch) -> bool:
    """In the last LATE_SHARE of its window: its lines no longer wait for interactive work
    to drain (a steady trickle of chats would otherwise hold them to the deadline); they
    run beside it, at the batch class, which the engine still ranks below interactive
    work. A batch thus has the first part of its window to fill idle capacity, and the
    rest to finish unless interactive work saturates the engine."""
    window = WINDOWS[batch.completion_window]
    return as_utc(batch.expires_at) - utcnow() < window * LATE_SHARE


def engine_slots(client: EngineClient | None) -> int:
    """The in-process engine's running slots (max_num_seqs); 128 for remote replicas.
    Batch lines hold half of them at most, so interactive work always finds a free slot
    instead of waiting for a line to finish or preempting one."""
    if isinstance(client, InProcessEngineClient):
        return client.engine.engine.config.seqs_limit
    return REMOTE_SLOTS


def _record(batch: Batch, line: BatchLine, cancelled: bool) -> dict[str, Any]:
    """A line of the output or error file, in OpenAI's shape."""
    record: dict[str, Any] = {
        "id": f"batch_req_{batch.id.removeprefix('batch_')}_{line.line}",
        "custom_id": line.custom_id,
        "response": None,
        "error": None,
    }
    if line.status == LineStatus.EXPIRED:
        code = "batch_cancelled" if cancelled else "batch_expired"
        message = "the batch was cancelled" if cancelled else "the batch's window closed"
        record["error"] = {"code": code, "message": f"{message} before this request ran"}
    else:
        record["response"] = {
            "status_code": line.status_code,
            "request_id": line.request_id,
            "body": line.result,
        }
    return record


def _jsonl(records: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(r, separators=(",", ":")).encode() + b"\n" for r in records)
