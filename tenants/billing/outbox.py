"""What the Stripe export has left to do and what needs an operator, putting parked rows
back in the queue, resolving unconfirmed ones, and the audit event of an export run by hand."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from tenants.audit import Audited
from tenants.billing.export_lock import STATE
from tenants.billing.models import (
    CustomerRequestStatus,
    ExportState,
    OutboxRow,
    OutboxStatus,
    StripeCustomerRequest,
)
from tenants.billing.relay import WARN_AGE, RelayResult
from tenants.billing.reports import Period
from tenants.models import Tenant, UsageEvent, utcnow


@dataclass(frozen=True)
class ExportStatus:
    pending: int
    exported: int
    failed: int
    oldest_pending: datetime | None  # when the oldest unsent row was written
    unconfirmed: int = 0  # maybe in Stripe, past its dedup window: an operator resolves them
    too_old: int = 0  # older than Stripe accepts: billed by hand
    near_limit: int = 0  # unexported with less than 7 days left before Stripe refuses them
    customers_failed: int = 0  # tenants whose Stripe customer Stripe refused to create
    meter_status: str | None = None  # at the relay's last check: active, inactive, missing
    meter_error: str | None = None

    def warnings(self) -> list[str]:
        """What an operator should act on, in words (the console's banner, the CLI)."""
        found = []
        if self.meter_status not in (None, "active"):
            found.append(f"Stripe meter {self.meter_status}: {self.meter_error}")
        if self.near_limit:
            found.append(
                f"{self.near_limit} unexported row(s) have less than 7 days left before "
                "Stripe's 35-day limit"
            )
        if self.too_old:
            found.append(
                f"{self.too_old} row(s) are {OutboxStatus.TOO_OLD}: bill them by hand "
                "(tollgate billing too-old)"
            )
        if self.unconfirmed:
            found.append(
                f"{self.unconfirmed} row(s) are {OutboxStatus.UNCONFIRMED}: check Stripe, then "
                "tollgate billing resolve --in-stripe or --not-in-stripe"
            )
        if self.customers_failed:
            found.append(
                f"{self.customers_failed} tenant(s) have no Stripe customer (Stripe refused "
                "it): link one or requeue"
            )
        return found

    def view(self) -> dict[str, object]:
        oldest = self.oldest_pending
        return {
            "pending": self.pending,
            "exported": self.exported,
            "failed": self.failed,
            "unconfirmed": self.unconfirmed,
            "too_old_for_stripe": self.too_old,
            "near_limit": self.near_limit,
            "customers_failed": self.customers_failed,
            "meter_status": self.meter_status,
            "oldest_pending": oldest.isoformat() if oldest is not None else None,
            "warnings": self.warnings(),
        }


@dataclass(frozen=True)
class TooOld:
    tenant_id: str
    tenant: str
    rows: int
    micros: int


class OutboxService(Audited):
    async def status(self, now: datetime | None = None) -> ExportStatus:
        moment = now or utcnow()
        rows = await self.session.execute(
            select(OutboxRow.status, func.count()).group_by(OutboxRow.status)
        )
        counts = {status: int(count) for status, count in rows}
        pending = OutboxRow.status == OutboxStatus.PENDING
        oldest = await self.session.scalar(select(func.min(OutboxRow.occurred_at)).where(pending))
        near = await self.session.scalar(
            select(func.count()).where(pending, OutboxRow.occurred_at < moment - WARN_AGE)
        )
        refused = await self.session.scalar(
            select(func.count()).where(StripeCustomerRequest.status == CustomerRequestStatus.FAILED)
        )
        state = await self.session.get(ExportState, STATE)
        return ExportStatus(
            pending=counts.get(OutboxStatus.PENDING, 0),
            exported=counts.get(OutboxStatus.EXPORTED, 0),
            failed=counts.get(OutboxStatus.FAILED, 0),
            oldest_pending=oldest,
            unconfirmed=counts.get(OutboxStatus.UNCONFIRMED, 0),
            too_old=counts.get(OutboxStatus.TOO_OLD, 0),
            near_limit=int(near or 0),
            customers_failed=int(refused or 0),
            meter_status=state.meter_status if state else None,
            meter_error=state.meter_error if state else None,
        )

    async def requeue_failed(self) -> int:
        """Rows (and customer creations) Stripe rejected go back to pending, after the
        cause was fixed; audited. The next run sends them under new idempotency keys, so
        no saved rejection is replayed."""
        result = await self.session.execute(
            update(OutboxRow)
            .where(OutboxRow.status == OutboxStatus.FAILED)
            .values(status=OutboxStatus.PENDING, next_attempt_at=None, attempts=0)
        )
        await self.session.execute(
            update(StripeCustomerRequest)
            .where(StripeCustomerRequest.status == CustomerRequestStatus.FAILED)
            .values(status=CustomerRequestStatus.PENDING, next_attempt_at=None, attempts=0)
        )
        count = int(result.rowcount or 0)  # type: ignore[attr-defined]
        await self._audit("billing.export.requeue", "stripe", None, rows=count)
        return count

    async def resolve_unconfirmed(self, in_stripe: bool, rows: list[int] | None = None) -> int:
        """An operator checked Stripe for the `unconfirmed` rows (all, or the outbox `rows`
        given): they are there (marked exported) or not (sent again, as never sent). Audited."""
        values: dict[str, object]
        if in_stripe:
            values = {"status": OutboxStatus.EXPORTED, "exported_at": utcnow()}
        else:
            values = {"status": OutboxStatus.PENDING, "maybe_sent_at": None, "attempts": 0}
        query = update(OutboxRow).where(OutboxRow.status == OutboxStatus.UNCONFIRMED)
        if rows is not None:
            query = query.where(OutboxRow.id.in_(rows))
        result = await self.session.execute(query.values(next_attempt_at=None, **values))
        count = int(result.rowcount or 0)  # type: ignore[attr-defined]
        await self._audit(
            "billing.export.resolve", "stripe", None, rows=count, in_stripe=in_stripe, only=rows
        )
        return count

    async def unconfirmed(self) -> list[OutboxRow]:
        """The rows to check in Stripe (by identifier, tg-usage-<usage id>)."""
        rows = await self.session.scalars(
            select(OutboxRow)
            .where(OutboxRow.status == OutboxStatus.UNCONFIRMED)
            .order_by(OutboxRow.id)
        )
        return list(rows)

    async def too_old(self) -> list[TooOld]:
        """Rows Stripe can no longer take, per tenant: what to bill by hand."""
        rows = await self.session.execute(
            select(Tenant.id, Tenant.name, func.count(), func.sum(OutboxRow.value))
            .join(Tenant, Tenant.id == OutboxRow.tenant_id)
            .where(OutboxRow.status == OutboxStatus.TOO_OLD)
            .group_by(Tenant.id, Tenant.name)
            .order_by(Tenant.name)
        )
        return [TooOld(tid, name, int(n), int(total or 0)) for tid, name, n, total in rows]

    async def record_export(self, result: RelayResult) -> dict[str, int]:
        """Audit an export someone ran by hand; returns its counts."""
        counts = result.counts()
        await self._audit("billing.export", "stripe", None, **counts)
        return counts


async def export_status(
    session: AsyncSession, tenant_id: str, period: Period
) -> dict[str, dict[str, int]]:
    """Stripe outbox rows of a tenant's period, by status: how many and how much."""
    rows = await session.execute(
        select(OutboxRow.status, func.count(), func.coalesce(func.sum(OutboxRow.value), 0))
        .where(
            OutboxRow.tenant_id == tenant_id,
            OutboxRow.occurred_at >= period.start,
            OutboxRow.occurred_at < period.end,
        )
        .group_by(OutboxRow.status)
    )
    return {status: {"rows": int(n), "micros": int(total)} for status, n, total in rows.all()}


async def unexported_rows(
    session: AsyncSession, tenant_id: str, period: Period, limit: int = 20
) -> list[tuple[OutboxRow, str]]:
    """The period's rows Stripe has not taken yet (failed first), with their request ids."""
    rows = await session.execute(
        select(OutboxRow, UsageEvent.request_id)
        .join(UsageEvent, UsageEvent.id == OutboxRow.usage_event_id)
        .where(
            OutboxRow.tenant_id == tenant_id,
            OutboxRow.occurred_at >= period.start,
            OutboxRow.occurred_at < period.end,
            OutboxRow.status != OutboxStatus.EXPORTED,
        )
        .order_by(OutboxRow.status, OutboxRow.id)  # "failed" sorts before "pending"
        .limit(limit)
    )
    return [(row, request_id) for row, request_id in rows.all()]
