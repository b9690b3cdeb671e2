"""Stripe Billing Meters through the `stripe` SDK: one meter (sum of micro-units), one
customer per tenant, one meter event per exported ledger row.

Delivery is at-least-once from our side and exactly-once in Stripe: every event carries a
deterministic `identifier` (Stripe rejects a second event with the same identifier as a
duplicate, which we read as "already delivered") and an Idempotency-Key derived from it.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import stripe

log = logging.getLogger(__name__)

DUPLICATE = "already exists with identifier"


class ExportDeferred(Exception):
    """Stripe did not take the event this time (rate limit, outage, timeout): try later."""


class ExportRejected(Exception):
    """Stripe refused the event for good (bad request): retrying cannot help."""


@dataclass(frozen=True)
class Retry:
    """Exponential backoff with full jitter, so exporters hitting one limit spread out."""

    attempts: int = 5
    base_s: float = 0.2
    cap_s: float = 5.0

    def delay_s(self, attempt: int) -> float:
        return random.uniform(0, min(self.cap_s, self.base_s * 2**attempt))


@dataclass(frozen=True)
class MeterEvent:
    identifier: str
    customer_id: str
    value: int
    timestamp: datetime


def event_identifier(usage_event_id: str) -> str:
    return f"tg-usage-{usage_event_id}"


class StripeMeters:
    def __init__(
        self,
        api_key: str,
        event_name: str,
        base_url: str | None = None,
        timeout_s: float = 20.0,
        retry: Retry = Retry(),
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        addresses: dict[str, str] = {}
        if base_url is not None:
            addresses = {"api": base_url, "meter_events": base_url}
        self.client = stripe.StripeClient(
            api_key,
            base_addresses=addresses,  # type: ignore[arg-type]
            max_network_retries=0,  # we retry, with jitter, and change keys after a 5xx
            http_client=stripe.RequestsClient(timeout=timeout_s),
        )
        self.event_name = event_name
        self.retry = retry
        self.sleep = sleep
        self._meter_ready = False

    def ensure_meter(self) -> None:
        """The meter our events feed: found by event name, created once if missing."""
        if self._meter_ready:
            return
        meters = self._call(lambda key: self.client.v1.billing.meters.list({"limit": 100}))
        if not any(m.event_name == self.event_name for m in meters.data):
            params: dict[str, Any] = {
                "display_name": "Tollgate usage (micro-units)",
                "event_name": self.event_name,
                "default_aggregation": {"formula": "sum"},
                "customer_mapping": {"type": "by_id", "event_payload_key": "stripe_customer_id"},
                "value_settings": {"event_payload_key": "value"},
            }
            self._call(
                lambda key: self.client.v1.billing.meters.create(
                    params,  # type: ignore[arg-type]
                    {"idempotency_key": key},
                ),
                f"tg-meter-{self.event_name}",
            )
        self._meter_ready = True

    def create_customer(self, tenant_id: str, tenant_name: str) -> str:
        params: dict[str, Any] = {
            "name": tenant_name,
            "metadata": {"tollgate_tenant_id": tenant_id},
        }
        customer = self._call(
            lambda key: self.client.v1.customers.create(
                params,  # type: ignore[arg-type]
                {"idempotency_key": key},
            ),
            f"tg-customer-{tenant_id}",
        )
        return str(customer.id)

    def send(self, event: MeterEvent) -> None:
        """Deliver one event, or raise ExportDeferred / ExportRejected."""
        params: dict[str, Any] = {
            "event_name": self.event_name,
            "identifier": event.identifier,
            "payload": {"stripe_customer_id": event.customer_id, "value": str(event.value)},
            "timestamp": int(event.timestamp.timestamp()),
        }
        try:
            self._call(
                lambda key: self.client.v1.billing.meter_events.create(
                    params,  # type: ignore[arg-type]
                    {"idempotency_key": key},
                ),
                event.identifier,
            )
        except ExportRejected as exc:
            if DUPLICATE in str(exc):
                return  # an earlier attempt got through (its answer was lost): delivered
            raise

    def _call(self, request: Callable[[str], Any], key: str = "") -> Any:
        """Run `request` with an idempotency key, retrying what may succeed later. A v1 key
        replays even a saved 500, so after a 5xx the next attempt takes a new key (the
        identifier still prevents a double count)."""
        current = key
        for attempt in range(self.retry.attempts):
            try:
                return request(current)
            except stripe.InvalidRequestError as exc:
                raise ExportRejected(_message(exc)) from None
            except (stripe.APIConnectionError, stripe.RateLimitError) as exc:
                error: stripe.StripeError = exc
            except stripe.StripeError as exc:
                status = exc.http_status or 0
                if status not in (409, 429) and status < 500:
                    raise ExportRejected(_message(exc)) from None
                error = exc
                if status >= 500:
                    current = f"{key}-r{attempt + 1}"
            if attempt + 1 < self.retry.attempts:
                self.sleep(self.retry.delay_s(attempt))
        raise ExportDeferred(_message(error))


def _message(exc: stripe.StripeError) -> str:
    return f"{type(exc).__name__} ({exc.http_status}): {exc.user_message or exc}"
