"""Billing upkeep inside the gateway: for the embedded default (no Redis, so no Celery) the
same Stripe relay and rollups the Celery beat schedules in the stack; in both modes, the
export's health as metrics (rows by state, rows near Stripe's 35 days, the meter)."""

from __future__ import annotations

import asyncio
import logging

from prometheus_client import CollectorRegistry, Gauge
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.billing.stripe import export_once
from gateway.core.tasks import Periodic
from gateway.settings import Settings
from tenants.billing.export_lock import ExportBusy
from tenants.billing.outbox import ExportStatus, OutboxService
from tenants.billing.rollups import ROLLUP_EVERY_S, rebuild_recent

log = logging.getLogger(__name__)

HEALTH_EVERY_S = 60.0


class ExportGauges:
    """What an alert on the Stripe export needs, refreshed every minute."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.rows = Gauge(
            "tollgate_stripe_export_rows",
            "Outbox rows by export state; near_limit: unexported with < 7 days before "
            "Stripe's 35-day limit",
            ["state"],
            registry=registry,
        )
        self.meter_active = Gauge(
            "tollgate_stripe_meter_active",
            "1 if the Stripe meter was active at the relay's last check, else 0",
            registry=registry,
        )

    def update(self, status: ExportStatus) -> None:
        for state, count in [
            ("pending", status.pending),
            ("failed", status.failed),
            ("unconfirmed", status.unconfirmed),
            ("too_old_for_stripe", status.too_old),
            ("near_limit", status.near_limit),
            ("customers_refused", status.customers_failed),
        ]:
            self.rows.labels(state).set(count)
        self.meter_active.set(1 if status.meter_status in (None, "active") else 0)


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

    async def refresh_health(self, gauges: ExportGauges) -> ExportStatus:
        async with self.sessions() as session:
            status = await OutboxService(session).status()
        gauges.update(status)
        return status

    def health(self, registry: CollectorRegistry) -> Periodic:
        """The export's gauges on `registry` (only with Stripe on: nothing to watch else)."""
        if self.settings.stripe_api_key is None:
            return Periodic([])
        gauges = ExportGauges(registry)
        return Periodic([(lambda: self.refresh_health(gauges), HEALTH_EVERY_S)])

    async def rollup(self) -> None:
        async with self.sessions.begin() as session:
            await rebuild_recent(session)

    def periodic(self) -> Periodic:
        return Periodic(
            [(self.export, float(self.settings.export_interval_s)), (self.rollup, ROLLUP_EVERY_S)]
        )
