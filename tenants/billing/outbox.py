"""What the Stripe export has left to do, putting parked rows back in the queue, and the
audit event of an export run by hand."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from tenants import audit
from tenants.audit import SYSTEM, Actor
from tenants.billing.models import OutboxRow, OutboxStatus
from tenants.billing.relay import RelayResult


@dataclass(frozen=True)
class ExportStatus:
    pending: int
    exported: int
    failed: int
    oldest_pending: datetime | None  # when the oldest unsent row was written

    def view(self) -> dict[str, object]:
        oldest = self.oldest_pending
        return {
            "pending": self.pending,
            "exported": self.exported,
            "failed": self.failed,
            "oldest_pending": oldest.isoformat() if oldest is not None else None,
        }


class OutboxService:
    def __init__(self, session: AsyncSession, actor: Actor = SYSTEM) -> None:
        self.session = session
        self.actor = actor

    async def status(self) -> ExportStatus:
        rows = await self.session.execute(
            select(OutboxRow.status, func.count()).group_by(OutboxRow.status)
        )
        counts = {status: int(count) for status, count in rows}
        oldest = await self.session.scalar(
            select(func.min(OutboxRow.occurred_at)).where(OutboxRow.status == OutboxStatus.PENDING)
        )
        return ExportStatus(
            pending=counts.get(OutboxStatus.PENDING, 0),
            exported=counts.get(OutboxStatus.EXPORTED, 0),
            failed=counts.get(OutboxStatus.FAILED, 0),
            oldest_pending=oldest,
        )

    async def requeue_failed(self) -> int:
        """Rows Stripe rejected go back to pending (after the cause was fixed); audited."""
        result = await self.session.execute(
            update(OutboxRow)
            .where(OutboxRow.status == OutboxStatus.FAILED)
            .values(status=OutboxStatus.PENDING, next_attempt_at=None, attempts=0)
        )
        count = int(result.rowcount or 0)  # type: ignore[attr-defined]
        await audit.record(
            self.session,
            actor=self.actor.name,
            action="billing.export.requeue",
            target="stripe",
            details={"rows": count},
            context=self.actor.context,
        )
        return count

    async def record_export(self, result: RelayResult) -> dict[str, int]:
        """Audit an export someone ran by hand; returns its counts."""
        counts = result.counts()
        await audit.record(
            self.session,
            actor=self.actor.name,
            action="billing.export",
            target="stripe",
            details=counts,
            context=self.actor.context,
        )
        return counts
