"""The Stripe export as the gateway's settings configure it: the meter client and the
relay, built by whoever runs an export (the gateway's job, the admin API, the CLI, the
Celery worker's entry point)."""

from __future__ import annotations

from datetime import timedelta

from gateway.settings import Settings
from tenants.billing.export import sync_engine
from tenants.billing.relay import Relay, RelayResult
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


def _relay(settings: Settings) -> Relay | None:
    """A relay on its own small engine pool (the caller disposes of `relay.engine`);
    None when Stripe is off."""
    meters = stripe_meters(settings)
    if meters is None:
        return None
    redelay = timedelta(seconds=settings.export_retry_s)
    return Relay(sync_engine(settings.database_url), meters, redelay=redelay)


def export_once(settings: Settings, budget_s: float = 60.0) -> RelayResult | None:
    """One relay run; None when Stripe is off. ExportBusy if another run holds the lock."""
    relay = _relay(settings)
    if relay is None:
        return None
    try:
        return relay.run(budget_s)
    finally:
        relay.engine.dispose()
