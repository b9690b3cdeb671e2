"""One export run, wherever it runs: a Celery task in the stack, the gateway's own
periodic job in the embedded default, or `tollgate billing export`."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from functools import cache

from sqlalchemy import Engine, create_engine

from gateway.settings import Settings
from tenants import db
from tenants.billing.relay import Relay, RelayResult
from tenants.billing.rollups import rebuild_recent
from tenants.billing.stripe_meters import Retry, StripeMeters


def stripe_meters(settings: Settings) -> StripeMeters | None:
    """None without TOLLGATE_STRIPE_API_KEY: the ledger is kept, nothing is exported."""
    if settings.stripe_api_key is None:
        return None
    return StripeMeters(
        settings.stripe_api_key,
        settings.stripe_meter_event,
        base_url=settings.stripe_base_url,
        timeout_s=settings.stripe_timeout_s,
        retry=Retry(base_s=settings.stripe_retry_base_ms / 1000),
    )


def sync_engine(database_url: str) -> Engine:
    url = db.sync_url(database_url)
    if url.get_backend_name() == "sqlite":
        return create_engine(url, connect_args={"timeout": 30})
    return create_engine(url, pool_size=2, max_overflow=2, pool_pre_ping=True)


@cache
def relay_for(settings: Settings) -> Relay | None:
    """One relay per process and settings (its engine pool and customer map are reused)."""
    meters = stripe_meters(settings)
    if meters is None:
        return None
    redelay = timedelta(seconds=settings.export_retry_s)
    return Relay(sync_engine(settings.database_url), meters, redelay=redelay)


def export_once(settings: Settings, budget_s: float = 60.0) -> RelayResult | None:
    """One relay run; None when Stripe is off. ExportBusy if another run holds the lock."""
    relay = relay_for(settings)
    return None if relay is None else relay.run(budget_s)


def rollup_once(settings: Settings) -> int:
    async def run() -> int:
        engine = db.create_engine(settings.database_url)
        try:
            async with db.session_factory(engine).begin() as session:
                return await rebuild_recent(session)
        finally:
            await engine.dispose()

    return asyncio.run(run())
