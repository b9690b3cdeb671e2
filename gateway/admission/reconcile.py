"""Repairs quota counters from the ledger, and other periodic upkeep.

Settling writes the ledger row first and then charges the quota store; a gateway that
dies between the two leaves a row the store never charged. The reconciler finds such
rows (the store remembers which ids it charged) and charges them, once: the same
marker guards settle and charge, so a late settle and the reconciler never both count.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.tasks import Periodic
from tenants.idempotency import IdempotencyService
from tenants.models import UsageEvent, as_utc, utcnow
from tenants.quota import QuotaStore, month_period

log = logging.getLogger(__name__)

BATCH = 500


async def reconcile(
    sessions: async_sessionmaker[AsyncSession],
    store: QuotaStore,
    since: datetime,
    until: datetime,
) -> int:
    """Charge every ledger row of [since, until) the store has not charged; returns how many."""
    repaired = 0
    async with sessions() as session:
        rows = await session.stream(
            select(
                UsageEvent.request_id,
                UsageEvent.tenant_id,
                UsageEvent.api_key_id,
                UsageEvent.cost_micros,
                UsageEvent.created_at,
            )
            .where(UsageEvent.created_at >= since, UsageEvent.created_at < until)
            .where(UsageEvent.cost_micros > 0)
            .execution_options(yield_per=BATCH)
        )
        async for batch in rows.partitions(BATCH):
            done = await store.charged([row.request_id for row in batch])
            for row in batch:
                if row.request_id in done:
                    continue
                scopes = (f"tenant:{row.tenant_id}", f"key:{row.api_key_id}")
                period = month_period(as_utc(row.created_at))
                if await store.charge(row.request_id, scopes, period, row.cost_micros):
                    repaired += 1
    if repaired:
        log.warning("reconciler charged %d ledger rows the quota store had missed", repaired)
    return repaired


class Upkeep:
    """Periodic jobs of one gateway process. They are idempotent, so replicas running
    them side by side do no harm."""

    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        store: QuotaStore,
        lease_s: float,
    ) -> None:
        self.sessions = sessions
        self.store = store
        self.lease_s = lease_s

    async def reconcile_recent(self) -> None:
        now = utcnow()
        # Rows younger than two leases may still be settling; older than an hour were
        # reconciled by earlier rounds.
        await reconcile(
            self.sessions,
            self.store,
            since=now - timedelta(hours=1),
            until=now - timedelta(seconds=2 * self.lease_s),
        )

    async def clean_idempotency(self) -> None:
        async with self.sessions.begin() as session:
            await IdempotencyService(session).delete_expired()

    def periodic(self) -> Periodic:
        return Periodic(
            [
                (self.reconcile_recent, 60.0),
                (self.store.expire_leases, self.lease_s),
                (self.clean_idempotency, 3600.0),
            ]
        )
