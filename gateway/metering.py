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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.admission.quota import Admission
from gateway.admission.reconcile import to_us
from gateway.tasks import Periodic, TaskSet
from gateway.telemetry.tracing import REQUEST_ID, in_span
from gateway.usage import Charge, RequestUsage
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


class UsageRecorder:
    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        prices: PriceBook,
        tasks: TaskSet,
        admission: Admission,
        checkpoint_s: float = CHECKPOINT_S,
    ) -> None:
        self.sessions = sessions
        self.prices = prices
        self.tasks = tasks
        self.admission = admission
        self.checkpoint_s = checkpoint_s
        self._streams: dict[str, tuple[Charge, RequestUsage]] = {}  # running, for checkpoints
        self._checkpoints: asyncio.Task[None] | None = None

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

    def settle(self, charge: Charge, outcome: RequestUsage) -> asyncio.Task[None]:
        """Write the row for this outcome as it is now (later changes do not leak in)."""
        write = self._write(charge, replace(outcome))
        return self.tasks.spawn(in_span("settle", write, **{REQUEST_ID: charge.request_id}))

    async def _event(self, charge: Charge, outcome: RequestUsage) -> UsageEvent:
        quote = await self.prices.quote(charge.model, charge.started_at)
        # A request refused by the engine, or that failed on our side before sending
        # anything, costs the tenant nothing.
        free = outcome.status == UsageStatus.REJECTED or (
            outcome.status == UsageStatus.FAILED and outcome.completion_tokens == 0
        )
        cost = quote.price.cost_micros(
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

    async def _write(self, charge: Charge, outcome: RequestUsage) -> None:
        """Ledger first, once; then quota counters from it: spent always matches the
        ledger (a crash in between leaves a row the reconciler charges later; a store
        outage, a settle the recorder retries until the store takes it)."""
        cost = tokens = 0
        at_us: int | None = None
        request_id = charge.request_id
        self._streams.pop(request_id, None)
        try:
            event = await self._event(charge, outcome)
            cost = event.cost_micros
            tokens = event.prompt_tokens + event.completion_tokens
            async with self.sessions.begin() as session:
                await UsageService(session).record(event)
                await session.execute(
                    delete(UsageCheckpoint).where(UsageCheckpoint.request_id == request_id)
                )
            at_us = to_us(event.created_at)
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
        now = utcnow()
        streams = [v for k, v in self._streams.items() if only is None or k in only]
        rows = [_checkpoint_row(charge, outcome, now) for charge, outcome in streams]
        if not rows:
            return 0
        async with self.sessions.begin() as session:
            dialect = (await session.connection()).dialect.name
            insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
            statement = insert(UsageCheckpoint).values(rows)
            changing = ("prompt_tokens", "cached_tokens", "completion_tokens", "replica")
            statement = statement.on_conflict_do_update(
                index_elements=["request_id"],
                set_={name: statement.excluded[name] for name in (*changing, "updated_at")},
            )
            await session.execute(statement)
        return len(rows)

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
        billed = 0
        for checkpoint in stale:
            if checkpoint.request_id not in self._streams and await self._bill(checkpoint):
                billed += 1
        if billed:
            log.warning("billed %d streams of a gateway that died, from checkpoints", billed)
        return billed

    async def _bill(self, checkpoint: UsageCheckpoint) -> bool:
        """The orphan's ledger row, unless its own gateway wrote one or refreshed it (then
        it is alive), or another gateway billed it first."""
        event = await self._orphan_event(checkpoint)
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

    async def _orphan_event(self, checkpoint: UsageCheckpoint) -> UsageEvent:
        started_at = as_utc(checkpoint.started_at)
        quote = await self.prices.quote(checkpoint.model, started_at)
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
