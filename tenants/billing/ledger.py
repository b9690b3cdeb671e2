"""The usage ledger write: the usage rows and their outbox rows, in the caller's
transaction, so a row is exported to Stripe exactly when it exists in the ledger."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy.ext.asyncio import AsyncSession

from tenants.billing.models import OutboxRow
from tenants.models import UsageEvent, new_id, utcnow


async def record(session: AsyncSession, event: UsageEvent) -> None:
    await record_all(session, [event])


async def record_all(session: AsyncSession, events: Sequence[UsageEvent]) -> None:
    """Several requests' rows in one flush each (a gateway commits settles in groups)."""
    for event in events:
        event.id = event.id or new_id()
        event.created_at = event.created_at or utcnow()
    session.add_all(events)
    await session.flush()  # the usage rows first: the outbox rows refer to them
    billed = [  # nothing to bill, nothing to export
        OutboxRow(
            usage_event_id=event.id,
            tenant_id=event.tenant_id,
            value=event.cost_micros,
            occurred_at=event.created_at,
        )
        for event in events
        if event.cost_micros > 0
    ]
    if billed:
        session.add_all(billed)
        await session.flush()
