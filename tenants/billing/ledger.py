"""The usage ledger write: the usage row and its outbox row, in the caller's transaction,
so a row is exported to Stripe exactly when it exists in the ledger."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncSession

from tenants.billing.models import OutboxRow
from tenants.models import UsageEvent, new_id, utcnow


async def record(session: AsyncSession, event: UsageEvent) -> None:
    event.id = event.id or new_id()
    event.created_at = event.created_at or utcnow()
    session.add(event)
    await session.flush()  # the usage row first: the outbox row refers to it
    if event.cost_micros > 0:  # nothing to bill, nothing to export
        session.add(
            OutboxRow(
                usage_event_id=event.id,
                tenant_id=event.tenant_id,
                value=event.cost_micros,
                occurred_at=event.created_at,
            )
        )
        await session.flush()
