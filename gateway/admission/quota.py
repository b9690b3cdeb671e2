"""Quotas at the door: one atomic check-and-reserve before dispatch, settle after.

Every request reserves its worst case — prompt tokens at the input price plus max_tokens
at the output price — in its tenant's scope and its key's scope at once. The lease is
renewed while the request runs, so a crashed gateway strands nothing for long. Settling
releases the reservation and charges the actual cost, after the ledger row is written.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from dataclasses import dataclass

from gateway.errors import RateLimited
from gateway.telemetry import current_request
from tenants.limits import LimitSet
from tenants.pricing import Price
from tenants.quota import (
    Denied,
    DenyReason,
    Granted,
    Limits,
    QuotaStore,
    Reservation,
    ReserveRequest,
    Scope,
    WindowStatus,
    month_period,
)
from tenants.services import Principal

log = logging.getLogger(__name__)


class QuotaExceeded(RateLimited):
    """Out of budget: waiting does not help, so no Retry-After."""

    default_code = "insufficient_quota"
    type = "insufficient_quota"


@dataclass(frozen=True)
class Ticket:
    """An admitted request's reservation and the rate-limit headers to send back."""

    reservation: Reservation
    headers: dict[str, str]


def scopes(principal: Principal) -> tuple[Scope, ...]:
    return (
        Scope(f"tenant:{principal.tenant_id}", _limits(principal.plan.limits)),
        Scope(f"key:{principal.key_id}", _limits(principal.key_limits)),
    )


def _limits(limits: LimitSet) -> Limits:
    return Limits(
        rpm=limits.rpm,
        tpm=limits.tpm,
        max_concurrent=limits.max_concurrent,
        budget_micros=limits.monthly_budget_micros,
    )


def rate_headers(requests: WindowStatus, tokens: WindowStatus) -> dict[str, str]:
    headers: dict[str, str] = {}
    for kind, status in (("requests", requests), ("tokens", tokens)):
        if status.limit is not None and status.remaining is not None:
            headers[f"x-ratelimit-limit-{kind}"] = str(status.limit)
            headers[f"x-ratelimit-remaining-{kind}"] = str(status.remaining)
            headers[f"x-ratelimit-reset-{kind}"] = f"{status.reset_s:.3f}s"
    return headers


class Admission:
    def __init__(self, store: QuotaStore, price: Price, lease_s: float, max_life_s: float) -> None:
        self.store = store
        self.price = price
        self.lease_s = lease_s  # a crashed gateway's reservations come back within this
        # Renewal stops after max_life_s (past the request timeout): a reservation whose
        # settle never comes (a stream the client left before it began) then expires.
        self.max_life_s = max_life_s
        self._live: dict[str, tuple[Reservation, float]] = {}
        self._keeper: asyncio.Task[None] | None = None

    async def reserve(
        self,
        principal: Principal,
        request_id: str,
        prompt_tokens: int,
        max_tokens: int,
        price: Price | None = None,  # the price book's, for this model now
    ) -> Ticket:
        price = price or self.price
        outcome = await self.store.reserve(
            ReserveRequest(
                reservation_id=request_id,
                scopes=scopes(principal),
                tokens=prompt_tokens + max_tokens,
                cost_micros=price.cost_micros(prompt_tokens, 0, max_tokens),
                period=month_period(),
                lease_s=self.lease_s,
            )
        )
        if isinstance(outcome, Denied):
            current_request().reject(outcome.reason.value)  # rpm, tpm, concurrency, budget
            raise _denial(outcome)
        assert isinstance(outcome, Granted)
        deadline = asyncio.get_running_loop().time() + self.max_life_s
        self._live[request_id] = (outcome.reservation, deadline)
        return Ticket(outcome.reservation, rate_headers(outcome.requests, outcome.tokens))

    async def settle(self, reservation: Reservation, tokens: int, cost_micros: int) -> None:
        self._live.pop(reservation.reservation_id, None)
        await self.store.settle(reservation, tokens, cost_micros)

    def start(self) -> None:
        self._keeper = asyncio.get_running_loop().create_task(self._renew_forever())

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self.lease_s / 3)  # a renewal period, not synchronisation
            now = asyncio.get_running_loop().time()
            for request_id in [r for r, (_, end) in self._live.items() if end < now]:
                del self._live[request_id]
            if self._live:
                try:
                    await self.store.renew([r for r, _ in self._live.values()], self.lease_s)
                except Exception:  # Redis briefly away: the next round tries again
                    log.warning("lease renewal failed", exc_info=True)

    async def close(self) -> None:
        if self._keeper is not None:
            self._keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keeper
        await self.store.aclose()


def _denial(denied: Denied) -> RateLimited:
    headers = rate_headers(denied.requests, denied.tokens)
    if denied.reason is DenyReason.BUDGET:
        return QuotaExceeded(
            "this request's worst-case cost does not fit the remaining monthly budget; "
            "lower max_tokens or raise the budget",
            headers=headers,
        )
    if denied.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(denied.retry_after_s)))
    limit = {
        DenyReason.RPM: "requests per minute",
        DenyReason.TPM: "tokens per minute",
        DenyReason.CONCURRENCY: "concurrent requests",
    }[denied.reason]
    scope = "key" if denied.scope_key.startswith("key:") else "tenant"
    return RateLimited(f"rate limit reached: {limit} for this {scope}", headers=headers)
