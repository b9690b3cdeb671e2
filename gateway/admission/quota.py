"""Quotas at the door: one atomic check-and-reserve before dispatch, settle after.

Every request reserves its worst case — prompt tokens at the input price plus max_tokens
at the output price — in its tenant's scope and its key's scope at once. The lease is
renewed while the request runs, so a crashed gateway strands nothing for long; a lease
the store lost (a restart) or let lapse (an outage) is restored while the request runs.
Settling releases the reservation and charges the actual cost, after the ledger row is
written; a settle the store cannot take now is retried in the background until it does
(the ledger row is the truth: the answer to the client never depends on the store).

A store that does not know a period's spend (it came up empty) refuses reservations;
admission then starts a rebuild from the ledger and waits for it briefly, else answers
503 with Retry-After. A store that cannot be reached is a 503 with Retry-After too.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from gateway.core.errors import QuotaStoreUnavailable, RateLimited
from gateway.core.tasks import Periodic
from gateway.telemetry import current_request
from tenants.limits import LimitSet
from tenants.pricing import Price
from tenants.quota import (
    CONCURRENCY_RETRY_HINT_S,
    KEY_SCOPE,
    Denied,
    DenyReason,
    Granted,
    Limits,
    QuotaError,
    QuotaStore,
    Reservation,
    ReserveRequest,
    Scope,
    ScopeUsage,
    SpendUnknownError,
    StoreUnavailableError,
    WindowStatus,
    binding,
    key_scope,
    month_period,
    tenant_scope,
)
from tenants.services import Principal

log = logging.getLogger(__name__)

REBUILD_WAIT_S = 2.0  # how long a request waits for a rebuild before a 503
SETTLE_RETRY_S = 1.0  # how often settles the store refused are tried again
STORE_RETRY_AFTER = "1"  # Retry-After of a 503 for a store outage


class Rebuilds(Protocol):
    """Starts (or joins) a rebuild of a period's spend; True if it finished in time."""

    async def wait(self, period: str, timeout_s: float) -> bool: ...


@dataclass(frozen=True)
class Unsettled:
    """A settle the store has not taken yet: the ledger row exists, the charge must follow."""

    reservation: Reservation
    tokens: int
    cost_micros: int
    at_us: int | None = None
    failures: int = field(default=1, compare=False)


class QuotaExceeded(RateLimited):
    """Out of budget: waiting does not help, so no Retry-After."""

    default_code = "insufficient_quota"
    type = "insufficient_quota"
    retryable = False


@dataclass(frozen=True)
class Ticket:
    """An admitted request's reservation and the rate-limit headers to send back."""

    reservation: Reservation
    headers: dict[str, str]


def scopes(principal: Principal) -> tuple[Scope, ...]:
    return (
        Scope(tenant_scope(principal.tenant_id), _limits(principal.plan.limits)),
        Scope(key_scope(principal.key_id), _limits(principal.key_limits)),
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
        self.rebuilds: Rebuilds | None = None  # set by the app: who rebuilds spend
        self._live: dict[str, tuple[Reservation, float]] = {}
        self._unsettled: dict[str, Unsettled] = {}
        self._loops = Periodic(
            [
                (self._renew_round, lease_s / 3),  # three renewals per lease: two may fail
                (self._settle_round, SETTLE_RETRY_S),
            ]
        )

    async def reserve(
        self,
        principal: Principal,
        request_id: str,
        prompt_tokens: int,
        max_tokens: int,
        price: Price | None = None,  # the price book's, for this model now
    ) -> Ticket:
        price = price or self.price
        scoped = scopes(principal)
        request = ReserveRequest(
            reservation_id=request_id,
            scopes=scoped,
            tokens=prompt_tokens + max_tokens,
            cost_micros=price.cost_micros(prompt_tokens, 0, max_tokens),
            period=month_period(),
            lease_s=self.lease_s,
        )
        outcome = await self._reserve(request)
        if isinstance(outcome, Denied):
            current_request().reject(outcome.reason.value)  # rpm, tpm, concurrency, budget
            raise _denial(outcome, scoped)
        assert isinstance(outcome, Granted)
        deadline = asyncio.get_running_loop().time() + self.max_life_s
        self._live[request_id] = (outcome.reservation, deadline)
        return Ticket(outcome.reservation, rate_headers(outcome.requests, outcome.tokens))

    async def _reserve(self, request: ReserveRequest) -> Granted | Denied:
        """The store's answer; spend unknown: rebuild, wait briefly, try once more."""
        try:
            try:
                return await self.store.reserve(request)
            except SpendUnknownError as unknown:
                if self.rebuilds is None or not await self.rebuilds.wait(
                    unknown.period, REBUILD_WAIT_S
                ):
                    raise
                return await self.store.reserve(request)
        except SpendUnknownError as unknown:
            current_request().reject("spend_unknown")
            retry_after = str(max(1, math.ceil(unknown.retry_after_s)))
            raise QuotaStoreUnavailable(
                "this tenant's spend is being rebuilt from the ledger; retry shortly",
                code="spend_rebuilding",
                headers={"Retry-After": retry_after},
            ) from unknown
        except StoreUnavailableError as down:
            current_request().reject("store_unavailable")
            raise QuotaStoreUnavailable(
                "the quota store is unavailable; retry shortly",
                headers={"Retry-After": STORE_RETRY_AFTER},
            ) from down

    async def refuse_if_exhausted(self, principal: Principal) -> None:
        """Before expensive work (tokenizing a long prompt), refuse a caller whose request
        window, concurrency or budget is already used up, without waiting for the token
        count. Read-only and advisory: reserve() stays the one atomic check. The refusal
        carries the binding x-ratelimit-* headers, as reserve()'s does."""
        period = month_period()
        scoped = scopes(principal)
        try:
            usages = [await self.store.usage(scope.key, period) for scope in scoped]
        except (StoreUnavailableError, SpendUnknownError):
            return  # reserve() answers these properly
        for scope, usage in zip(scoped, usages, strict=True):
            reason = _exhausted(scope.limits, usage)
            if reason is not None:
                current_request().reject(reason.value)
                raise _early_denial(reason, scope, usage, usage_headers(scoped, usages))

    @property
    def unsettled(self) -> int:
        """Settles waiting for the store to take them."""
        return len(self._unsettled)

    async def settle(
        self, reservation: Reservation, tokens: int, cost_micros: int, at_us: int | None = None
    ) -> None:
        """Settle now, or keep it for the background retry: this never fails the request."""
        self._live.pop(reservation.reservation_id, None)
        pending = Unsettled(reservation, tokens, cost_micros, at_us)
        if not await self._try_settle(pending):
            self._unsettled[reservation.reservation_id] = pending

    async def _try_settle(self, pending: Unsettled) -> bool:
        try:
            await self.store.settle(
                pending.reservation, pending.tokens, pending.cost_micros, pending.at_us
            )
        except Exception as exc:  # the store away, or anything else: never fail the request
            log.warning(
                "settle of %s deferred (%s): retrying in the background",
                pending.reservation.reservation_id,
                exc,
                exc_info=not isinstance(exc, QuotaError),
            )
            return False
        return True

    async def settle_pending(self) -> int:
        """Try every deferred settle once; returns how many are still waiting."""
        for request_id, pending in list(self._unsettled.items()):
            if await self._try_settle(pending):
                self._unsettled.pop(request_id, None)
            else:
                break  # the store is still away: the next round tries again
        return len(self._unsettled)

    def start(self) -> None:
        self._loops.start()

    async def _settle_round(self) -> None:
        if self._unsettled:
            await self.settle_pending()

    async def _renew_round(self) -> None:
        now = asyncio.get_running_loop().time()
        for request_id in [r for r, (_, end) in self._live.items() if end < now]:
            del self._live[request_id]
        if self._live:
            try:
                await self._renew_live()
            except Exception:  # store briefly away: the next round tries again
                log.warning("lease renewal failed", exc_info=True)

    async def _renew_live(self) -> None:
        """Renew every running request's lease; give back those the store lost."""
        live = [r for r, _ in self._live.values()]
        renewed = await self.store.renew(live, self.lease_s)
        lost = [r for r in live if r.reservation_id not in renewed]
        if lost:
            restored = await self.store.restore(lost, self.lease_s)
            log.warning("quota store had lost %d running reservations: restored", restored)

    async def close(self) -> None:
        await self._loops.close()
        if self._unsettled and await self.settle_pending():
            # The ledger has these rows: the reconciler charges them, and their leases
            # release the reserved budget.
            log.warning("%d settles left to the reconciler at shutdown", len(self._unsettled))
        await self.store.aclose()


_EXHAUSTED = {
    DenyReason.RPM: "rate limit reached: requests per minute",
    DenyReason.CONCURRENCY: "rate limit reached: concurrent requests",
    DenyReason.BUDGET: "the monthly budget is spent",
}


def _exhausted(limits: Limits, usage: ScopeUsage) -> DenyReason | None:
    """The limit, if any, that no request could pass now whatever its token count."""
    if limits.rpm is not None and usage.requests_in_window >= limits.rpm:
        return DenyReason.RPM
    if limits.max_concurrent is not None and usage.concurrent >= limits.max_concurrent:
        return DenyReason.CONCURRENCY
    budget = limits.budget_micros
    if budget is not None and usage.spent_micros + usage.reserved_micros >= budget:
        return DenyReason.BUDGET
    return None


def usage_headers(scoped: Sequence[Scope], usages: Sequence[ScopeUsage]) -> dict[str, str]:
    """The x-ratelimit-* headers of the binding windows, from the scopes' usage."""

    def status(limit: int | None, used: int, usage: ScopeUsage) -> WindowStatus:
        remaining = None if limit is None else max(0, limit - used)
        return WindowStatus(limit, remaining, usage.reset_s)

    pairs = list(zip(scoped, usages, strict=True))
    requests = binding([status(s.limits.rpm, u.requests_in_window, u) for s, u in pairs])
    tokens = binding([status(s.limits.tpm, u.tokens_in_window, u) for s, u in pairs])
    return rate_headers(requests, tokens)


def concurrency_headers(limit: int | None) -> dict[str, str]:
    """A concurrency refusal's limit (no OpenAI header names one: these are Tollgate's)."""
    if limit is None:
        return {}
    return {
        "x-ratelimit-limit-concurrent-requests": str(limit),
        "x-ratelimit-remaining-concurrent-requests": "0",
    }


def _who(scope_key: str) -> str:
    return "key" if scope_key.startswith(KEY_SCOPE) else "tenant"


def _early_denial(
    reason: DenyReason, scope: Scope, usage: ScopeUsage, headers: dict[str, str]
) -> RateLimited:
    """refuse_if_exhausted's refusal: `scope`'s `reason` limit is used up."""
    message = f"{_EXHAUSTED[reason]} for this {_who(scope.key)}"
    if reason is DenyReason.BUDGET:
        return QuotaExceeded(message, headers=headers)
    if reason is DenyReason.CONCURRENCY:
        headers |= concurrency_headers(scope.limits.max_concurrent)
        wait = CONCURRENCY_RETRY_HINT_S
    else:  # the minute's requests: a place frees when the oldest leaves the window
        wait = usage.oldest_leaves_s
    headers["Retry-After"] = str(max(1, math.ceil(wait)))
    return RateLimited(message, headers=headers)


def _denial(denied: Denied, scoped: Sequence[Scope]) -> RateLimited:
    headers = rate_headers(denied.requests, denied.tokens)
    if denied.reason is DenyReason.CONCURRENCY:
        limits = next(s.limits for s in scoped if s.key == denied.scope_key)
        headers |= concurrency_headers(limits.max_concurrent)
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
    return RateLimited(
        f"rate limit reached: {limit} for this {_who(denied.scope_key)}", headers=headers
    )
