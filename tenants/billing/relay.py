"""The outbox relay: ledger rows to Stripe meter events, each counted once.

One relay runs at a time per database (tenants/billing/export_lock.py). A batch of due
rows is claimed, stamped and committed, then sent one event per row, and each row's
outcome is written on its own: a row that keeps failing backs off alone and never holds
up the rows after it, nor other tenants. Customers are created the same way, each with
its own retry state. Synchronous on purpose: a Celery task calls it directly, the
gateway in a thread.

Why a row is never counted twice, over any horizon. Stripe has two 24-hour windows:

  W_id   an event's `identifier` is deduplicated for (at least) 24 h after Stripe
         recorded it;
  W_key  an Idempotency-Key's answer, 4xx and 5xx included, is saved and replayed for
         (at least) 24 h after the key's first use.

The identifier (tg-usage-<usage id>) is the row's permanent dedup key. `maybe_sent_at`
is committed before a row is first sent and kept while any attempt may have been
recorded without our knowing (a timeout, a dropped connection, a 5xx, a crash before the
outcome was written). While now < maybe_sent_at + W_id, a resend under any key counts at
most once: if an earlier attempt was recorded, Stripe answers "already exists", read as
delivered. So inside W_id the key may change, and it does: a new key every run (key_seq,
bumped in the stamping commit) and after every 5xx, so a saved 500, or a saved 400
whose cause has since been fixed, is never replayed (W_key would replay it for a day).
Past W_id neither window protects: the identifier is forgotten, and a key's saved answer
is only promised for 24 h after a first use that came no earlier than maybe_sent_at. So
the relay stops sending such a row a margin before W_id ends (RESEND_WINDOW): it becomes
`unconfirmed`, and an operator checks Stripe and resolves it. A row whose attempts all
got definite answers (429, 409, a 4xx) was not recorded and has no such limit.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import Enum
from typing import Protocol

from sqlalchemy import Engine, and_, or_, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from tenants.billing.export_lock import STATE, ExportLock
from tenants.billing.models import (
    CustomerRequestStatus,
    ExportState,
    OutboxRow,
    OutboxStatus,
    StripeCustomer,
    StripeCustomerRequest,
)
from tenants.billing.stripe_meters import (
    ExportDeferred,
    ExportError,
    ExportRejected,
    IdempotencyKeys,
    MeterEvent,
    MeterUnavailable,
    event_identifier,
)
from tenants.models import Tenant, as_utc, utcnow

log = logging.getLogger(__name__)

BATCH = 200
REDELAY = timedelta(seconds=30)  # a deferred row waits at least this long, doubling per try
MAX_REDELAY = timedelta(hours=1)
OUTAGE_STREAK = 5  # this many rows deferred in a row: Stripe is down, end the run
RESEND_WINDOW = timedelta(hours=23)  # W_id (24 h) less a margin for clocks and a run's length
STRIPE_MAX_AGE = timedelta(days=35) - timedelta(hours=1)  # Stripe takes events <= 35 days old
WARN_AGE = timedelta(days=35 - 7)  # unexported at this age: 7 days left, warn


class MeterSink(Protocol):
    def ensure_meter(self) -> str: ...
    def create_customer(self, tenant_id: str, tenant_name: str, keys: IdempotencyKeys) -> str: ...
    def send(self, event: MeterEvent) -> None: ...


@dataclass
class RelayResult:
    exported: int = 0
    deferred: int = 0
    rejected: int = 0
    claimed: int = 0
    unconfirmed: int = 0  # rows past RESEND_WINDOW this run: an operator resolves them
    too_old: int = 0  # rows past Stripe's 35 days this run
    near_limit: int = 0  # unexported rows with less than 7 days left
    outage: bool = False  # ended early: Stripe deferred OUTAGE_STREAK rows in a row
    meter_error: str | None = None  # the meter is inactive or missing: nothing was sent

    def counts(self) -> dict[str, int]:
        return {"exported": self.exported, "deferred": self.deferred, "rejected": self.rejected}

    def add(self, other: RelayResult) -> None:
        self.exported += other.exported
        self.deferred += other.deferred
        self.rejected += other.rejected
        self.claimed += other.claimed
        self.outage = self.outage or other.outage


class Outcome(Enum):
    EXPORTED = "exported"
    DEFERRED = "deferred"
    REJECTED = "rejected"
    UNSENT = "unsent"  # the run ended before this row's turn


@dataclass
class Planned:
    row_id: int
    attempts: int
    stamped: bool  # maybe_sent_at was set by this run (None before)
    event: MeterEvent
    outcome: Outcome = Outcome.UNSENT
    error: ExportError | None = None


@dataclass
class Relay:
    engine: Engine
    sink: MeterSink
    batch: int = BATCH
    redelay: timedelta = REDELAY
    clock: Callable[[], datetime] = utcnow
    lock: ExportLock = field(init=False)

    def __post_init__(self) -> None:
        self.lock = ExportLock(self.engine)

    def run(self, budget_s: float = 60.0) -> RelayResult:
        """Export batches until nothing is due or `budget_s` is spent (a batch in progress
        finishes). ExportBusy if another relay holds the lock."""
        total = RelayResult()
        deadline = time.monotonic() + budget_s
        with self.lock.hold():
            if not self._check_meter(total):
                return total
            self._retire(total)
            while time.monotonic() < deadline:
                self.lock.renew()
                self._create_customers()
                result = self.run_batch()
                total.add(result)
                if result.claimed < self.batch or result.outage:
                    break  # drained, or Stripe is down: the next run tries again
        if total.claimed:
            log.info(
                "stripe export: %d exported, %d deferred, %d rejected",
                total.exported,
                total.deferred,
                total.rejected,
            )
        return total

    # The meter and the rows Stripe can no longer take.

    def _check_meter(self, total: RelayResult) -> bool:
        try:
            self.sink.ensure_meter()
        except MeterUnavailable as exc:
            log.error("stripe export stopped: %s", exc)
            total.meter_error = str(exc)
            self._save_meter(exc.status, str(exc))
            return False
        except ExportError as exc:  # Stripe unreachable: nothing to learn about the meter
            log.warning("stripe export skipped, the meter could not be checked: %s", exc)
            total.meter_error = str(exc)
            total.outage = True
            return False
        self._save_meter("active", None)
        return True

    def _save_meter(self, status: str, error: str | None) -> None:
        values = {"meter_status": status, "meter_checked_at": self.clock(), "meter_error": error}
        insert = pg_insert if self.engine.dialect.name == "postgresql" else sqlite_insert
        with self.engine.begin() as connection:
            connection.execute(
                insert(ExportState)
                .values(name=STATE, **values)
                .on_conflict_do_update(index_elements=["name"], set_=values)
            )

    def _retire(self, total: RelayResult) -> None:
        """Rows past Stripe's 35 days, and rows maybe in Stripe past the resend window,
        leave the queue for an operator; rows with 7 days left are counted and logged."""
        now = self.clock()
        pending = OutboxRow.status == OutboxStatus.PENDING
        with Session(self.engine) as session, session.begin():
            too_old = session.execute(
                update(OutboxRow)
                .where(pending, OutboxRow.occurred_at < now - STRIPE_MAX_AGE)
                .values(status=OutboxStatus.TOO_OLD)
            )
            unconfirmed = session.execute(
                update(OutboxRow)
                .where(pending, OutboxRow.maybe_sent_at < now - RESEND_WINDOW)
                .values(status=OutboxStatus.UNCONFIRMED)
            )
            near = session.scalars(
                select(OutboxRow.id).where(pending, OutboxRow.occurred_at < now - WARN_AGE)
            ).all()
        total.too_old = int(too_old.rowcount or 0)  # type: ignore[attr-defined]
        total.unconfirmed = int(unconfirmed.rowcount or 0)  # type: ignore[attr-defined]
        total.near_limit = len(near)
        if total.too_old:
            log.error(
                "%d usage rows are older than Stripe accepts: marked %s, bill them by hand",
                total.too_old,
                OutboxStatus.TOO_OLD,
            )
        if total.unconfirmed:
            log.error(
                "%d usage rows were maybe recorded by Stripe and its dedup window has passed: "
                "marked %s, check Stripe and resolve them",
                total.unconfirmed,
                OutboxStatus.UNCONFIRMED,
            )
        if total.near_limit:
            log.warning(
                "%d unexported usage rows have less than 7 days left before Stripe refuses them",
                total.near_limit,
            )

    # Customers: created through the same claim, retry and error handling as events.

    def _create_customers(self) -> None:
        for tenant_id in self._tenants_needing_customers():
            self._create_customer(tenant_id)

    def _tenants_needing_customers(self) -> list[str]:
        now = self.clock()
        request = StripeCustomerRequest
        with Session(self.engine) as session:
            query = (
                select(OutboxRow.tenant_id)
                .outerjoin(StripeCustomer, StripeCustomer.tenant_id == OutboxRow.tenant_id)
                .outerjoin(request, request.tenant_id == OutboxRow.tenant_id)
                .where(OutboxRow.status == OutboxStatus.PENDING)
                .where(StripeCustomer.tenant_id.is_(None))
                .where(
                    or_(
                        request.tenant_id.is_(None),
                        and_(
                            request.status == CustomerRequestStatus.PENDING,
                            or_(request.next_attempt_at.is_(None), request.next_attempt_at <= now),
                        ),
                    )
                )
                .distinct()
            )
            return sorted(session.scalars(query))

    def _create_customer(self, tenant_id: str) -> None:
        with Session(self.engine) as session, session.begin():
            request = session.get(StripeCustomerRequest, tenant_id)
            if request is None:
                request = StripeCustomerRequest(tenant_id=tenant_id, updated_at=self.clock())
                session.add(request)
                session.flush()
            name = session.scalar(select(Tenant.name).where(Tenant.id == tenant_id)) or tenant_id
            keys = IdempotencyKeys(f"tg-customer-{tenant_id}", request.key_seq)
            attempts = request.attempts
        try:
            customer_id = self.sink.create_customer(tenant_id, name, keys)
        except ExportError as exc:
            self._customer_failed(tenant_id, keys, attempts, exc)
            return
        insert = pg_insert if self.engine.dialect.name == "postgresql" else sqlite_insert
        with Session(self.engine) as session, session.begin():
            session.execute(  # an operator's link made meanwhile wins
                insert(StripeCustomer)
                .values(tenant_id=tenant_id, customer_id=customer_id, created_at=self.clock())
                .on_conflict_do_nothing(index_elements=["tenant_id"])
            )
            stale = session.get(StripeCustomerRequest, tenant_id)
            if stale is not None:
                session.delete(stale)

    def _customer_failed(
        self, tenant_id: str, keys: IdempotencyKeys, attempts: int, exc: ExportError
    ) -> None:
        rejected = isinstance(exc, ExportRejected)
        log.log(
            logging.ERROR if rejected else logging.WARNING,
            "stripe customer for tenant %s not created: %s",
            tenant_id,
            exc,
        )
        with Session(self.engine) as session, session.begin():
            request = session.get_one(StripeCustomerRequest, tenant_id)
            request.attempts = attempts + 1
            request.key_seq = keys.n + (1 if rejected else 0)  # a requeue must not replay it
            request.last_error = str(exc)
            request.next_attempt_at = self.clock() + self._backoff(attempts + 1)
            request.updated_at = self.clock()
            if rejected:
                request.status = CustomerRequestStatus.FAILED

    # Events.

    def run_batch(self) -> RelayResult:
        result = RelayResult()
        planned = self._claim()
        result.claimed = len(planned)
        streak = 0
        for plan in planned:
            if streak >= OUTAGE_STREAK:
                result.outage = True
                break  # the rest stay as they were: not sent, not penalised
            try:
                self.sink.send(plan.event)
            except ExportDeferred as exc:
                plan.outcome, plan.error = Outcome.DEFERRED, exc
                result.deferred += 1
                streak += 1
                continue
            except ExportRejected as exc:
                log.error("stripe rejected usage row %s: %s", plan.event.identifier, exc)
                plan.outcome, plan.error = Outcome.REJECTED, exc
                result.rejected += 1
            else:
                plan.outcome = Outcome.EXPORTED
                result.exported += 1
            streak = 0
        self._record(planned)
        return result

    def _claim(self) -> list[Planned]:
        """The next due rows of tenants with a customer, each given this run's key and
        stamped "maybe in Stripe" before anything is sent (committed here)."""
        now = self.clock()
        resend_after = now - RESEND_WINDOW
        query = (
            select(OutboxRow, StripeCustomer.customer_id)
            .join(StripeCustomer, StripeCustomer.tenant_id == OutboxRow.tenant_id)
            .where(OutboxRow.status == OutboxStatus.PENDING)
            .where(or_(OutboxRow.next_attempt_at.is_(None), OutboxRow.next_attempt_at <= now))
            .where(OutboxRow.occurred_at >= now - STRIPE_MAX_AGE)
            .where(or_(OutboxRow.maybe_sent_at.is_(None), OutboxRow.maybe_sent_at >= resend_after))
            .order_by(OutboxRow.id)
            .limit(self.batch)
            .with_for_update(of=OutboxRow, skip_locked=True)
        )
        planned = []
        with Session(self.engine) as session, session.begin():
            for row, customer_id in session.execute(query):
                row.key_seq += 1
                stamped = row.maybe_sent_at is None
                if stamped:
                    row.maybe_sent_at = now
                identifier = event_identifier(row.usage_event_id)
                event = MeterEvent(
                    identifier=identifier,
                    customer_id=customer_id,
                    value=row.value,
                    timestamp=as_utc(row.occurred_at),
                    key_prefix=f"{identifier}-{row.key_seq}",
                )
                planned.append(Planned(row.id, row.attempts, stamped, event))
        return planned

    def _record(self, planned: list[Planned]) -> None:
        now = self.clock()
        with Session(self.engine) as session, session.begin():
            for plan in planned:
                values = self._outcome_values(plan, now)
                if values:
                    session.execute(
                        update(OutboxRow).where(OutboxRow.id == plan.row_id).values(**values)
                    )

    def _outcome_values(self, plan: Planned, now: datetime) -> dict[str, object]:
        values: dict[str, object] = {}
        maybe_recorded = plan.error is not None and plan.error.ambiguous
        if plan.stamped and plan.outcome is not Outcome.EXPORTED and not maybe_recorded:
            values["maybe_sent_at"] = None  # every answer was definite: not in Stripe
        if plan.outcome is Outcome.EXPORTED:
            values.update(status=OutboxStatus.EXPORTED, exported_at=now, last_error=None)
        elif plan.outcome is Outcome.DEFERRED:
            attempts = plan.attempts + 1
            values.update(
                attempts=attempts,
                last_error=str(plan.error),
                next_attempt_at=now + self._backoff(attempts),
            )
        elif plan.outcome is Outcome.REJECTED:
            values.update(
                status=OutboxStatus.FAILED, attempts=plan.attempts + 1, last_error=str(plan.error)
            )
        return values

    def _backoff(self, attempts: int) -> timedelta:
        factor: int = 2 ** min(attempts - 1, 10)
        return min(MAX_REDELAY, self.redelay * factor)
