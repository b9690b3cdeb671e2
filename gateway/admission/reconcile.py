"""Quota spend rebuilt from the ledger, and other periodic upkeep.

The ledger is the truth; the quota store's spent is derived from it. A rebuild of a
period sets every tenant's and key's spent to the ledger's sum of that period's rows
older than a cutoff (GRACE_S ago: any such row has surely committed), plus the charges
the store took one by one for rows at or after it; rows at or after the cutoff that the
store never took (their gateway died between the ledger write and the settle, or the
store was down) are charged then, once: the same marker guards settle and charge. See
tenants.quota.contract for why this counts every row exactly once, whatever runs at the
same time.

Every gateway rebuilds at start and every RECONCILE_EVERY_S; a store that came up empty
(a Redis restart) refuses reservations until a rebuild finishes, and the first refused
request starts one at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.core.tasks import Periodic
from tenants.billing import ledger
from tenants.idempotency import IdempotencyService
from tenants.models import as_utc, utcnow
from tenants.quota import QuotaStore, key_scope, month_period, tenant_scope

log = logging.getLogger(__name__)

BATCH = 500
CONCURRENT_CHARGES = 50  # charges in flight at once (each is one round trip)
GRACE_S = 300.0
"""Rows younger than this are charged one by one (with their markers) rather than put in
the base: a ledger transaction still open after this long is not expected."""
RECONCILE_EVERY_S = 60.0


def period_bounds(period: str) -> tuple[datetime, datetime]:
    """[start, end) of a "YYYY-MM" period, in UTC."""
    year, month = (int(part) for part in period.split("-"))
    start = datetime(year, month, 1, tzinfo=UTC)
    end = datetime(year + month // 12, month % 12 + 1, 1, tzinfo=UTC)
    return start, end


def previous_period(period: str) -> str:
    year, month = (int(part) for part in period.split("-"))
    return f"{year - (month == 1):04d}-{(month - 2) % 12 + 1:02d}"


def to_us(moment: datetime) -> int:
    return int(as_utc(moment).timestamp() * 1_000_000)


@dataclass(frozen=True)
class Rebuilt:
    """What one rebuild did."""

    period: str
    scopes: int  # scopes whose base was set
    charged: int  # recent rows the store had not taken
    ready: bool  # False: the store lost the rebuild (came up empty meanwhile)
    seconds: float


async def ledger_bases(
    sessions: async_sessionmaker[AsyncSession], since: datetime, until: datetime
) -> dict[str, int]:
    """Each tenant's and key's ledger cost of [since, until)."""
    bases: dict[str, int] = defaultdict(int)
    if until <= since:
        return bases
    async with sessions() as session:
        for tenant_id, key_id, cost in await ledger.cost_by_key(session, since, until):
            bases[tenant_scope(tenant_id)] += int(cost)
            bases[key_scope(key_id)] += int(cost)
    return bases


async def reconcile(
    sessions: async_sessionmaker[AsyncSession],
    store: QuotaStore,
    since: datetime,
    until: datetime,
) -> int:
    """Charge every ledger row of [since, until) the store has not charged; returns how many."""
    repaired = 0
    async with sessions() as session:
        rows = await ledger.costed_rows(session, since, until, BATCH)
        async for batch in rows.partitions(BATCH):
            done = await store.charged([row.request_id for row in batch])
            missing = [row for row in batch if row.request_id not in done]
            for start in range(0, len(missing), CONCURRENT_CHARGES):
                charges = [
                    _charge(store, row) for row in missing[start : start + CONCURRENT_CHARGES]
                ]
                repaired += sum(await asyncio.gather(*charges))
    return repaired


async def _charge(store: QuotaStore, row: Any) -> bool:
    scopes = (tenant_scope(row.tenant_id), key_scope(row.api_key_id))
    period = month_period(as_utc(row.created_at))
    return await store.charge(
        row.request_id, scopes, period, row.cost_micros, to_us(row.created_at)
    )


async def rebuild(
    sessions: async_sessionmaker[AsyncSession],
    store: QuotaStore,
    period: str | None = None,
    hold_s: float = 0.0,
) -> Rebuilt:
    """Rebuild one period's spend (default: this month's) from the ledger, then mark the
    period known (after hold_s if it was not: see QuotaStore.finish_rebuild)."""
    period = period or month_period()
    began = time.monotonic()
    start, end = period_bounds(period)
    token = await store.begin_rebuild(period)
    cutoff = max(start, min(end, utcnow() - timedelta(seconds=GRACE_S)))
    bases = await ledger_bases(sessions, start, cutoff)
    await store.rebase(period, to_us(cutoff), bases)
    charged = await reconcile(sessions, store, cutoff, end)
    ready = await store.finish_rebuild(period, token, hold_s)
    rebuilt = Rebuilt(period, len(bases), charged, ready, time.monotonic() - began)
    if charged or not ready:
        log.warning("quota rebuild of %s: %s", period, rebuilt)
    return rebuilt


async def recently_active(sessions: async_sessionmaker[AsyncSession], within_s: float) -> bool:
    """Whether any request ended within the last within_s (so a gateway may still be
    running others, whose leases it must restore before admission resumes)."""
    since = utcnow() - timedelta(seconds=within_s)
    async with sessions() as session:
        return await ledger.any_since(session, since)


class Rebuilder:
    """One rebuild at a time per period, started on demand (a refused reservation) or by
    the schedule; callers may wait for the running one."""

    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        store: QuotaStore,
        lease_s: float,
        max_life_s: float,
    ) -> None:
        self.sessions = sessions
        self.store = store
        self.lease_s = lease_s
        self.max_life_s = max_life_s
        self._running: dict[str, asyncio.Task[Rebuilt]] = {}

    def ensure(self, period: str | None = None) -> asyncio.Task[Rebuilt]:
        period = period or month_period()
        task = self._running.get(period)
        if task is None or task.done():
            task = asyncio.get_running_loop().create_task(self._run(period))
            task.add_done_callback(_log_failure)
            self._running[period] = task
        return task

    async def wait(self, period: str, timeout_s: float) -> bool:
        """Start (or join) a rebuild of `period`; True if it finished within timeout_s."""
        task = self.ensure(period)
        await asyncio.wait({task}, timeout=timeout_s)  # never cancels the rebuild
        return task.done() and not task.cancelled() and task.exception() is None

    async def _run(self, period: str) -> Rebuilt:
        hold_s = self.lease_s / 2 if await self._wiped(period) else 0.0
        return await rebuild(self.sessions, self.store, period, hold_s)

    async def _wiped(self, period: str) -> bool:
        """Whether the store lost what it knew while gateways may be running requests
        whose leases it lost too: then each gets a renewal round (every lease_s / 3) to
        restore them before admission resumes. A new month is not a loss: the last one
        is still known; neither is a first start: no request ended lately."""
        if await self.store.is_ready(period) or await self.store.is_ready(previous_period(period)):
            return False
        return await recently_active(self.sessions, self.max_life_s)

    async def close(self) -> None:
        for task in self._running.values():
            task.cancel()
        await asyncio.gather(*self._running.values(), return_exceptions=True)


def _log_failure(task: asyncio.Task[Rebuilt]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("quota rebuild failed; the next one tries again", exc_info=task.exception())


class Upkeep:
    """Periodic jobs of one gateway process, on the rebuilder's database and store. They
    are idempotent, so replicas running them side by side do no harm."""

    def __init__(self, rebuilder: Rebuilder) -> None:
        self.rebuilder = rebuilder

    async def reconcile_period(self) -> None:
        """The whole period's spend from the ledger: repairs any drift or lost charge."""
        await self.rebuilder.ensure()

    async def clean_idempotency(self) -> None:
        async with self.rebuilder.sessions.begin() as session:
            await IdempotencyService(session).delete_expired()

    def periodic(self) -> Periodic:
        return Periodic(
            [
                (self.reconcile_period, RECONCILE_EVERY_S),
                (self.rebuilder.store.expire_leases, self.rebuilder.lease_s),
                (self.clean_idempotency, 3600.0),
            ]
        )
