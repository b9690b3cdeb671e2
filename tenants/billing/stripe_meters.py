"""Stripe Billing Meters through the `stripe` SDK: one meter (sum of micro-units), one
customer per tenant, one meter event per exported ledger row.

Delivery is at-least-once from our side and exactly-once in Stripe: every event carries
its row's permanent `identifier` (Stripe answers a second event with it "already exists",
which we read as delivered) and an Idempotency-Key that changes whenever a saved answer
must not be replayed; tenants/billing/relay.py has the argument over both 24 h windows.
Each call reports whether it may have been recorded without our knowing (`ambiguous`).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from tenants.errors import TenantsError

if TYPE_CHECKING:
    import stripe

log = logging.getLogger(__name__)

DUPLICATE = "already exists with identifier"


class ExportError(TenantsError):
    def __init__(self, message: str, ambiguous: bool = False) -> None:
        super().__init__(message)
        # True when an attempt may have been recorded by Stripe (a timeout, a dropped
        # connection, a 5xx): the row stays "maybe in Stripe".
        self.ambiguous = ambiguous


class ExportDeferred(ExportError):
    """Stripe did not take the request this time (rate limit, outage, timeout): try later."""


class ExportRejected(ExportError):
    """Stripe refused the request for good (bad request): retrying cannot help."""


class MeterUnavailable(TenantsError):
    """The meter our events feed is inactive or missing: nothing can be exported."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status = status  # "inactive" | "missing"


@dataclass
class IdempotencyKeys:
    """The Idempotency-Keys of one request, attempt after attempt: `prefix.n`. A 5xx (or a
    key clash) moves `n` on, so a saved failure is never replayed; a 429, a 409 (key in
    use) or a dropped connection keeps it, so a replay returns the first attempt's answer."""

    prefix: str
    n: int = 0

    def current(self) -> str:
        return f"{self.prefix}.{self.n}"

    def rotate(self) -> None:
        self.n += 1


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
    key_prefix: str  # this run's keys: the identifier and the row's key_seq


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
        import stripe  # here, not at the top: the SDK costs every gateway ~0.5 s at start

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

    def ensure_meter(self) -> str:
        """The id of the active meter our events feed, created if there is none; checked
        every run (an operator may deactivate it). Raises MeterUnavailable."""
        listing = IdempotencyKeys("tg-meter-list")  # a GET sends no key; retries only
        meters = self._call(lambda key: list(self._meters()), listing)
        ours = [m for m in meters if m.event_name == self.event_name]
        active = [m for m in ours if m.status == "active"]
        if active:
            return str(active[0].id)
        if ours:
            raise MeterUnavailable(
                "inactive",
                f"the Stripe meter for {self.event_name!r} ({ours[0].id}) is inactive: "
                "reactivate it in Stripe; rows wait meanwhile",
            )
        params: dict[str, Any] = {
            "display_name": "Tollgate usage (micro-units)",
            "event_name": self.event_name,
            "default_aggregation": {"formula": "sum"},
            "customer_mapping": {"type": "by_id", "event_payload_key": "stripe_customer_id"},
            "value_settings": {"event_payload_key": "value"},
        }
        try:
            meter = self._call(
                lambda key: self.client.v1.billing.meters.create(
                    params,  # type: ignore[arg-type]
                    {"idempotency_key": key},
                ),
                IdempotencyKeys(f"tg-meter-{self.event_name}-{int(time.time())}"),
            )
        except ExportRejected as exc:
            raise MeterUnavailable(
                "missing", f"no Stripe meter for {self.event_name!r} and creating it failed: {exc}"
            ) from None
        log.info("created the Stripe meter %s for %r", meter.id, self.event_name)
        return str(meter.id)

    def _meters(self) -> Any:
        return self.client.v1.billing.meters.list({"limit": 100}).auto_paging_iter()

    def create_customer(self, tenant_id: str, tenant_name: str, keys: IdempotencyKeys) -> str:
        """The new customer's id; `keys.n` tells the caller which key to start from next."""
        params: dict[str, Any] = {
            "name": tenant_name,
            "metadata": {"tollgate_tenant_id": tenant_id},
        }
        customer = self._call(
            lambda key: self.client.v1.customers.create(
                params,  # type: ignore[arg-type]
                {"idempotency_key": key},
            ),
            keys,
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
                IdempotencyKeys(event.key_prefix),
            )
        except ExportRejected as exc:
            if DUPLICATE in str(exc):
                return  # an earlier attempt got through (its answer was lost): delivered
            raise

    def _call(self, request: Callable[[str], Any], keys: IdempotencyKeys) -> Any:
        """Run `request`, retrying (with jitter) what may succeed later."""
        import stripe

        ambiguous = False
        error: stripe.StripeError | None = None
        for attempt in range(self.retry.attempts):
            try:
                return request(keys.current())
            except stripe.IdempotencyError as exc:
                keys.rotate()  # a key clash: the saved answer is not ours to replay
                error = exc
            except stripe.InvalidRequestError as exc:
                raise ExportRejected(_message(exc), ambiguous) from None
            except (stripe.RateLimitError, stripe.AuthenticationError) as exc:
                error = exc  # not executed: a wrong key defers rows instead of failing them
            except stripe.APIConnectionError as exc:
                ambiguous = True  # it may have reached Stripe; the same key replays it
                error = exc
            except stripe.StripeError as exc:
                status = exc.http_status or 0
                if status >= 500:
                    ambiguous = True  # maybe recorded, then failed: a new key next
                    keys.rotate()
                elif status not in (403, 409):  # 409: the key's first request still runs
                    raise ExportRejected(_message(exc), ambiguous) from None
                error = exc
            if attempt + 1 < self.retry.attempts:
                self.sleep(self.retry.delay_s(attempt))
        assert error is not None
        raise ExportDeferred(_message(error), ambiguous)


def _message(exc: stripe.StripeError) -> str:
    return f"{type(exc).__name__} ({exc.http_status}): {exc.user_message or exc}"
