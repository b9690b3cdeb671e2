"""Billing upkeep inside the gateway, for the embedded default (no Redis, so no Celery):
the same Stripe relay and rollups the Celery beat schedules in the stack."""

from __future__ import annotations

import asyncio
import logging

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.settings import Settings
from gateway.tasks import Periodic
from tenants.billing.export import export_once
from tenants.billing.export_lock import ExportBusy
from tenants.billing.rollups import ROLLUP_EVERY_S, rebuild_recent

log = logging.getLogger(__name__)


class BillingJobs:
    def __init__(self, settings: Settings, sessions: async_sessionmaker[AsyncSession]) -> None:
        self.settings = settings
        self.sessions = sessions

    @staticmethod
    def wanted(settings: Settings) -> bool:
        """With TOLLGATE_REDIS_URL set, Celery beat runs these jobs, not the gateway."""
        return settings.redis_url is None

    async def export(self) -> None:
        if self.settings.stripe_api_key is not None:
            # The relay is synchronous (the Stripe SDK and a sync engine): off the loop.
            try:
                await asyncio.to_thread(export_once, self.settings)
            except ExportBusy:
                log.info("stripe export skipped: another run holds the lock")

    async def rollup(self) -> None:
        async with self.sessions.begin() as session:
            await rebuild_recent(session)

    def periodic(self) -> Periodic:
        return Periodic(
            [(self.export, float(self.settings.export_interval_s)), (self.rollup, ROLLUP_EVERY_S)]
        )
