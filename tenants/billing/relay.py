"""The outbox relay: ledger rows to Stripe meter events, each counted once.

A batch of pending outbox rows is claimed with FOR UPDATE SKIP LOCKED (relays running side
by side take disjoint rows), sent one event per row, and marked exported in the claiming
transaction, so only after Stripe accepted them. A relay killed mid-batch leaves its rows
pending; the next run sends them again with the same identifiers and Stripe counts each
once. Synchronous on purpose: a Celery task calls it directly, the gateway in a thread.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Protocol

from sqlalchemy import Engine, or_, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from tenants.billing.models import OutboxRow, OutboxStatus, StripeCustomer
from tenants.billing.stripe_meters import (
    ExportDeferred,
    ExportRejected,
    MeterEvent,
    event_identifier,
)
from tenants.models import Tenant, as_utc, utcnow

log = logging.getLogger(__name__)

BATCH = 200
REDELAY = timedelta(seconds=30)  # a deferred row waits at least this long, doubling per try
MAX_REDELAY = timedelta(hours=1)


class MeterSink(Protocol):
    def ensure_meter(self) -> None: ...
    def create_customer(self, tenant_id: str, tenant_name: str) -> str: ...
    def send(self, event: MeterEvent) -> None: ...


@dataclass
class RelayResult:
    exported: int = 0
    deferred: int = 0
    rejected: int = 0
    claimed: int = 0

    def counts(self) -> dict[str, int]:
        return {"exported": self.exported, "deferred": self.deferred, "rejected": self.rejected}

    def add(self, other: RelayResult) -> None:
        self.exported += other.exported
        self.deferred += other.deferred
        self.rejected += other.rejected
        self.claimed += other.claimed


@dataclass
class Relay:
    engine: Engine
    sink: MeterSink
    batch: int = BATCH
    _customers: dict[str, str] = field(default_factory=dict)  # tenant id -> Stripe customer

    def run(self, budget_s: float = 60.0) -> RelayResult:
        """Export batches until the outbox has nothing due or `budget_s` is spent (a batch
        in progress finishes)."""
        total = RelayResult()
        deadline = time.monotonic() + budget_s
        self._customers.clear()  # re-read each run: an operator may have relinked a tenant
        self.sink.ensure_meter()
        while time.monotonic() < deadline:
            result = self.run_batch()
            total.add(result)
            if result.claimed < self.batch or result.deferred:
                break  # drained, or Stripe is struggling: let the next run try
        if total.claimed:
            log.info(
                "stripe export: %d exported, %d deferred, %d rejected",
                total.exported,
                total.deferred,
                total.rejected,
            )
        return total

    def run_batch(self) -> RelayResult:
        result = RelayResult()
        self._map_customers(self._due_tenants())
        with Session(self.engine) as session, session.begin():
            rows = self._claim(session)
            result.claimed = len(rows)
            customers = self._map_customers({row.tenant_id for row in rows}, session)
            for index, row in enumerate(rows):
                try:
                    self.sink.send(_event(row, customers[row.tenant_id]))
                except ExportDeferred as exc:
                    # Stripe is rate limiting or down: this row and the rest wait.
                    for waiting in rows[index:]:
                        _defer(waiting, str(exc))
                    result.deferred = len(rows) - index
                    break
                except ExportRejected as exc:
                    log.error("stripe rejected usage row %s: %s", row.usage_event_id, exc)
                    row.status = OutboxStatus.FAILED
                    row.last_error = str(exc)
                    result.rejected += 1
                    continue
                row.status = OutboxStatus.EXPORTED
                row.exported_at = utcnow()
                result.exported += 1
        return result

    def _claim(self, session: Session) -> list[OutboxRow]:
        now = utcnow()
        query = (
            select(OutboxRow)
            .where(OutboxRow.status == OutboxStatus.PENDING)
            .where(or_(OutboxRow.next_attempt_at.is_(None), OutboxRow.next_attempt_at <= now))
            .order_by(OutboxRow.id)
            .limit(self.batch)
            .with_for_update(skip_locked=True)
        )
        return list(session.scalars(query))

    def _due_tenants(self) -> set[str]:
        """Tenants of the next batch, so their customers exist before rows are locked."""
        with Session(self.engine) as session:
            due = (
                select(OutboxRow.tenant_id)
                .where(OutboxRow.status == OutboxStatus.PENDING)
                .order_by(OutboxRow.id)
                .limit(self.batch)
                .subquery()
            )
            return set(session.scalars(select(due.c.tenant_id).distinct()))

    def _map_customers(
        self, tenant_ids: set[str], session: Session | None = None
    ) -> dict[str, str]:
        """Stripe customers of these tenants, created and mapped where missing: in their own
        committed transaction, or in `session` for a tenant that appeared since (creation's
        idempotency key makes a repeat return the same customer)."""
        missing = tenant_ids - self._customers.keys()
        if missing:
            with Session(self.engine) as reader:
                mapped = reader.execute(
                    select(StripeCustomer.tenant_id, StripeCustomer.customer_id).where(
                        StripeCustomer.tenant_id.in_(missing)
                    )
                )
                self._customers.update({row.tenant_id: row.customer_id for row in mapped})
        for tenant_id in sorted(tenant_ids - self._customers.keys()):
            if session is None:
                with Session(self.engine) as own, own.begin():
                    self._customers[tenant_id] = self._create_customer(own, tenant_id)
            else:
                self._customers[tenant_id] = self._create_customer(session, tenant_id)
        return {tenant_id: self._customers[tenant_id] for tenant_id in tenant_ids}

    def _create_customer(self, session: Session, tenant_id: str) -> str:
        name = session.scalar(select(Tenant.name).where(Tenant.id == tenant_id)) or tenant_id
        customer_id = self.sink.create_customer(tenant_id, name)
        insert = pg_insert if self.engine.dialect.name == "postgresql" else sqlite_insert
        session.execute(
            insert(StripeCustomer)
            .values(tenant_id=tenant_id, customer_id=customer_id, created_at=utcnow())
            .on_conflict_do_nothing(index_elements=["tenant_id"])
        )
        stored = session.scalar(
            select(StripeCustomer.customer_id).where(StripeCustomer.tenant_id == tenant_id)
        )
        return stored or customer_id


def _event(row: OutboxRow, customer_id: str) -> MeterEvent:
    return MeterEvent(
        identifier=event_identifier(row.usage_event_id),
        customer_id=customer_id,
        value=row.value,
        timestamp=as_utc(row.occurred_at),
    )


def _defer(row: OutboxRow, error: str) -> None:
    row.attempts += 1
    row.last_error = error
    row.next_attempt_at = utcnow() + min(MAX_REDELAY, REDELAY * 2 ** min(row.attempts - 1, 10))
