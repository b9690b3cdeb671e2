"""Daily rollups: the ledger summed per tenant, model and UTC day into usage_daily.

Rebuilding a day replaces its rows from the ledger, so the job is idempotent and a late
ledger row is picked up by the next run; it rebuilds today and yesterday by default.
"""

from __future__ import annotations

from datetime import UTC, date, datetime, time, timedelta

from sqlalchemy import delete, insert
from sqlalchemy.ext.asyncio import AsyncSession

from tenants.billing.ledger import daily_sums
from tenants.billing.models import DailyUsage
from tenants.models import utcnow

ROLLUP_EVERY_S = 300.0  # how often the recent days are rebuilt (Celery beat, or in process)


async def rebuild_days(session: AsyncSession, first: date, last: date) -> int:
    """Replace the rollups of days [first, last]; returns how many rows were written."""
    start = datetime.combine(first, time(), tzinfo=UTC)
    end = datetime.combine(last + timedelta(days=1), time(), tzinfo=UTC)
    summed = daily_sums(session.get_bind().dialect.name, start, end)
    await session.execute(delete(DailyUsage).where(DailyUsage.day.between(first, last)))
    result = await session.execute(
        insert(DailyUsage).from_select(
            [
                "day",
                "tenant_id",
                "model",
                "requests",
                "prompt_tokens",
                "cached_tokens",
                "completion_tokens",
                "cost_micros",
                "updated_at",
            ],
            summed,
        )
    )
    return int(result.rowcount or 0)  # type: ignore[attr-defined]


async def rebuild_recent(session: AsyncSession, days: int = 2) -> int:
    today = utcnow().date()
    return await rebuild_days(session, today - timedelta(days=days - 1), today)
