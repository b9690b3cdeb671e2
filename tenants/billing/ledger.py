"""The usage ledger write: the usage rows and their outbox rows, in the caller's
transaction, so a row is exported to Stripe exactly when it exists in the ledger."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from sqlalchemy import Table, insert, inspect
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from tenants.billing.models import OutboxRow
from tenants.models import UsageEvent, new_id, utcnow


async def record(session: AsyncSession, event: UsageEvent) -> None:
    await record_all(session, [event])


async def record_all(session: AsyncSession | AsyncConnection, events: Sequence[UsageEvent]) -> None:
    """Several requests' rows, one INSERT per table (a gateway commits settles in groups).
    Core inserts, not the ORM's unit of work (nor its bulk path): that flush was most of
    a settle's CPU, and the rows are not read back here. The events stay transient."""
    for event in events:
        event.id = event.id or new_id()
        event.created_at = event.created_at or utcnow()
    by_columns: dict[frozenset[str], list[dict[str, Any]]] = {}
    for event in events:  # one executemany per set of columns given (the rest: defaults)
        values = _values(event)
        by_columns.setdefault(frozenset(values), []).append(values)
    for rows in by_columns.values():
        await session.execute(_INSERT_USAGE, rows)
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
        await session.execute(_INSERT_OUTBOX, billed)


def _values(event: UsageEvent) -> dict[str, Any]:
    """The event's values by column name: those it was given; the others get their
    column defaults."""
    given = event.__dict__
    return {column: given[key] for key, column in _USAGE_COLUMNS if key in given}


# (attribute, column) of every mapped column
_USAGE_COLUMNS = tuple(
    (attr.key, attr.columns[0].name) for attr in inspect(UsageEvent).column_attrs
)
_USAGE_TABLE = cast(Table, UsageEvent.__table__)
_OUTBOX_TABLE = cast(Table, OutboxRow.__table__)
# inline: nothing read back (no RETURNING of generated keys), so on PostgreSQL the rows can
# go in a pipeline that waits for no answer before its Sync (gateway.metering)
_INSERT_USAGE = insert(_USAGE_TABLE).inline()
_INSERT_OUTBOX = insert(_OUTBOX_TABLE).inline()
