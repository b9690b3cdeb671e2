"""The usage ledger write: the usage rows and their outbox rows, in the caller's
transaction, so a row is exported to Stripe exactly when it exists in the ledger."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import insert, inspect
from sqlalchemy.ext.asyncio import AsyncSession

from tenants.billing.models import OutboxRow
from tenants.models import UsageEvent, new_id, utcnow


async def record(session: AsyncSession, event: UsageEvent) -> None:
    await record_all(session, [event])


async def record_all(session: AsyncSession, events: Sequence[UsageEvent]) -> None:
    """Several requests' rows, one INSERT per table (a gateway commits settles in groups).
    Bulk inserts, not the ORM's unit of work: that flush was most of a settle's CPU, and
    the rows are not read back here. The events stay transient (not in the session)."""
    for event in events:
        event.id = event.id or new_id()
        event.created_at = event.created_at or utcnow()
    await session.execute(insert(UsageEvent), [_values(event) for event in events])
    billed = [  # nothing to bill, nothing to export; after the usage rows they refer to
        {
            "usage_event_id": event.id,
            "tenant_id": event.tenant_id,
            "value": event.cost_micros,
            "occurred_at": event.created_at,
        }
        for event in events
        if event.cost_micros > 0
    ]
    if billed:
        await session.execute(insert(OutboxRow), billed)


def _values(event: UsageEvent) -> dict[str, Any]:
    """The attributes the event was given; those it was not get their column defaults."""
    given = event.__dict__
    return {key: given[key] for key in _USAGE_ATTRIBUTES if key in given}


_USAGE_ATTRIBUTES = tuple(attr.key for attr in inspect(UsageEvent).column_attrs)
