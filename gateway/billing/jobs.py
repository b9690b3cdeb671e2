"""Billing upkeep inside the gateway, for the embedded default (no Redis, so no Celery):
the same Stripe relay and rollups the Celery beat schedules in the stack."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.settings import Settings
from tenants.billing.export import export_once
from tenants.billing.rollups import rebuild_recent

log = logging.getLogger(__name__)

ROLLUP_EVERY_S = 300.0


class BillingJobs:
    def __init__(self, settings: Settings, sessions: async_sessionmaker[AsyncSession]) -> None:
        self.settings = settings
        self.sessions = sessions
        self._tasks: list[asyncio.Task[None]] = []

    @staticmethod
    def wanted(settings: Settings) -> bool:
        """With TOLLGATE_REDIS_URL set, Celery beat runs these jobs, not the gateway."""
        return settings.redis_url is None

    async def export(self) -> None:
        if self.settings.stripe_api_key is not None:
            # The relay is synchronous (the Stripe SDK and a sync engine): off the loop.
            await asyncio.to_thread(export_once, self.settings)

    async def rollup(self) -> None:
        async with self.sessions.begin() as session:
            await rebuild_recent(session)

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        for job, every_s in (
            (self.export, float(self.settings.export_interval_s)),
            (self.rollup, ROLLUP_EVERY_S),
        ):
            self._tasks.append(loop.create_task(_every(every_s, job)))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def _every(period_s: float, job: Callable[[], Awaitable[None]]) -> None:
    while True:
        await asyncio.sleep(period_s)  # a schedule, not synchronisation
        try:
            await job()
        except Exception:
            log.exception("billing job %s failed", job.__name__)
