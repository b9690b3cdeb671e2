"""The quota store contract: one atomic check-and-reserve step, leases, idempotent settles.

Two implementations keep this contract: `MemoryQuotaStore` (one process, the embedded
default) and `RedisQuotaStore` (any number of gateway replicas sharing one Redis, each
operation one Lua script). The contract tests run against both.

Semantics, shared by both implementations:

- A reservation names 1..MAX_SCOPES scopes ("tenant_id:<id>", "key_id:<id>"). Every limit of
  every scope is checked and, only if all pass, every scope is charged, atomically.
- Requests and tokens are limited over a sliding window of WINDOW_S seconds: an
  admission at time t counts while now - t < WINDOW_S. A request is admitted only if
  the requests already in the window are below `rpm` and the tokens already in the
  window plus its own worst case fit `tpm`, so no window of WINDOW_S seconds ever holds
  more than `tpm` admitted tokens (as long as settles report no more tokens than were
  reserved).
- Concurrency counts live leases. Budget: spent + reserved + cost <= budget, per period.
  The period is an opaque string the caller picks (`month_period()` gives "YYYY-MM").
- A lease expires lease_s after reserve or the last renew. An expired lease is dead at
  once (it no longer counts, and renew cannot revive it); its bookkeeping is released
  lazily by the next operation that touches the scope, or by `expire_leases()`.
- settle() releases the lease if it is still live, replaces the worst-case tokens in the
  window by the actual tokens, and charges the actual cost exactly once per reservation
  id (a "done" marker kept for `settled_ttl_s`). charge() uses the same marker, so the
  reconciler and a late settle never both charge one ledger row.
- Spent is rebuilt from the ledger, never trusted blind. rebase() sets a scope's spent
  of a period to the ledger's sum of rows older than a cutoff plus the charges the store
  took for rows at or after it (settle and charge pass the row's time `at_us`; a charge
  older than the cutoff only sets its marker, since the base has it). A guarded store
  refuses reserve() with SpendUnknownError until a rebuild of that period finished
  (begin_rebuild .. finish_rebuild) since the store last came up empty.
- restore() re-creates the leases of reservations a live gateway still runs after the
  store lost them (a restart) or let them expire (an outage longer than a lease).
- Money (micro-units) and tokens are integers everywhere; both stay below 2**53 so the
  Redis scripts (Lua numbers are doubles) compute them exactly.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Protocol, runtime_checkable

from tenants.errors import TenantsError

WINDOW_S = 60
"""Length of the sliding window behind rpm and tpm, in seconds. The stores take a
window_s argument so tests can shorten it; every replica must use the same value."""
WINDOW_US = WINDOW_S * 1_000_000
MAX_SCOPES = 8
"""Most scopes one reservation may name."""
MAX_INT = 2**53 - 1
"""Largest token count or amount of money the stores accept (exact in a double)."""
CONCURRENCY_RETRY_HINT_S = 1.0
"""Cap on retry_after_s for a concurrency denial: a slot frees when any request finishes,
which no store can predict; the earliest lease expiry is only an upper bound."""
DEFAULT_SETTLED_TTL_S = 3 * 24 * 3600
"""How long the "done" marker of a settled or charged id is kept (repeat = no-op)."""


class DenyReason(StrEnum):
    """Why a reservation was refused, in the order the checks run within one scope."""

    RPM = "rpm"
    TPM = "tpm"
    CONCURRENCY = "concurrency"
    BUDGET = "budget"


class QuotaError(TenantsError):
    """Base for errors the quota store raises on purpose."""


class SpendUnknownError(QuotaError):
    """The store does not know this period's spend yet (it came up empty and no rebuild
    from the ledger has finished): admitting now would be admitting blind."""

    def __init__(self, period: str, retry_after_s: float) -> None:
        super().__init__(f"spend of period {period} is being rebuilt from the ledger")
        self.period = period
        self.retry_after_s = retry_after_s


class StoreUnavailableError(QuotaError):
    """The store cannot be reached (connection refused, reset or timed out)."""


class ReservationIdError(QuotaError):
    """A reservation id that cannot be used: already settled, or reused after its lease
    expired while its admission is still in the window. Ids must be unique per request."""


TENANT_SCOPE = "tenant_id:"  # ids: audit targets use "tenant:<name>", "key:<prefix>"
KEY_SCOPE = "key_id:"


def tenant_scope(tenant_id: str) -> str:
    """The scope key of a tenant's limits, by its id (audit targets name it by name)."""
    return f"{TENANT_SCOPE}{tenant_id}"


def key_scope(key_id: str) -> str:
    """The scope key of an API key's limits, by its id (audit targets use its prefix)."""
    return f"{KEY_SCOPE}{key_id}"


def _check_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if not 0 <= value <= MAX_INT:
        raise ValueError(f"{name} must be between 0 and 2**53 - 1, got {value}")


def _check_name(name: str, value: str) -> None:
    if not isinstance(value, str) or not value or any(c.isspace() for c in value):
        raise ValueError(f"{name} must be a non-empty string without whitespace: {value!r}")


@dataclass(frozen=True, slots=True)
class Limits:
    """Limits of one scope; None means unlimited. budget_micros applies per period."""

    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None
    budget_micros: int | None = None

    def __post_init__(self) -> None:
        for name in ("rpm", "tpm", "max_concurrent", "budget_micros"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value)


@dataclass(frozen=True, slots=True)
class Scope:
    """One thing that is limited, e.g. "tenant_id:<id>" or "key_id:<id>", with its limits."""

    key: str
    limits: Limits

    def __post_init__(self) -> None:
        _check_name("scope key", self.key)


@dataclass(frozen=True, slots=True)
class Reservation:
    """The handle settle() and renew() take: everything needed to find the reservation
    in one round trip, even after its lease expired. The gateway keeps it for the
    request's lifetime (and may persist it; it is three plain fields)."""

    reservation_id: str
    scope_keys: tuple[str, ...]
    period: str
    cost_micros: int = 0  # the worst case reserved, for restore()


@dataclass(frozen=True, slots=True)
class ReserveRequest:
    """Reserve `tokens` (worst case, counts against tpm) and `cost_micros` (worst case,
    counts against the budget of `period`) in every scope, with a lease of lease_s."""

    reservation_id: str
    scopes: tuple[Scope, ...]
    tokens: int
    cost_micros: int
    period: str
    lease_s: float

    def __post_init__(self) -> None:
        _check_name("reservation_id", self.reservation_id)
        _check_name("period", self.period)
        if not 1 <= len(self.scopes) <= MAX_SCOPES:
            raise ValueError(f"a reservation names 1..{MAX_SCOPES} scopes")
        keys = [scope.key for scope in self.scopes]
        if len(set(keys)) != len(keys):
            raise ValueError(f"duplicate scope keys: {keys}")
        _check_int("tokens", self.tokens)
        _check_int("cost_micros", self.cost_micros)
        check_lease(self.lease_s)

    @property
    def reservation(self) -> Reservation:
        keys = tuple(s.key for s in self.scopes)
        return Reservation(self.reservation_id, keys, self.period, self.cost_micros)


def check_lease(lease_s: float) -> int:
    """lease_s as whole microseconds (at least 1 ms), or ValueError."""
    if not 0.001 <= lease_s <= 30 * 24 * 3600:
        raise ValueError(f"lease_s must be between 0.001 and 30 days, got {lease_s}")
    return int(lease_s * 1_000_000)


def check_window(window_s: float) -> int:
    """window_s as whole microseconds, or ValueError."""
    if not 0.001 <= window_s <= 24 * 3600:
        raise ValueError(f"window_s must be between 0.001 s and one day, got {window_s}")
    return int(window_s * 1_000_000)


def wall_us() -> int:
    """Now on the wall clock, in microseconds: the ledger's clock (rows' created_at)."""
    return time.time_ns() // 1000


def check_rebase(period: str, cutoff_us: int, bases: Mapping[str, int]) -> None:
    _check_name("period", period)
    _check_int("cutoff_us", cutoff_us)
    for key, base in bases.items():
        _check_name("scope key", key)
        _check_int("base", base)


def check_settle(actual_tokens: int, actual_cost_micros: int) -> None:
    _check_int("actual_tokens", actual_tokens)
    _check_int("actual_cost_micros", actual_cost_micros)


def check_charge(charge_id: str, scope_keys: Sequence[str], period: str, cost: int) -> None:
    _check_name("charge_id", charge_id)
    _check_name("period", period)
    if not 1 <= len(scope_keys) <= MAX_SCOPES or len(set(scope_keys)) != len(scope_keys):
        raise ValueError(f"charge names 1..{MAX_SCOPES} distinct scopes: {list(scope_keys)}")
    for key in scope_keys:
        _check_name("scope key", key)
    _check_int("cost_micros", cost)


@dataclass(frozen=True, slots=True)
class WindowStatus:
    """Requests or tokens of one scope's window, for the x-ratelimit-* headers.

    limit and remaining are None when unlimited. reset_s: seconds until the window is
    back to its full limit (the newest admission leaves it), OpenAI's meaning of
    x-ratelimit-reset-*; 0 when the window is empty.
    """

    limit: int | None
    remaining: int | None
    reset_s: float


@dataclass(frozen=True, slots=True)
class Granted:
    """Admitted: the reservation holds its lease. Statuses are the binding ones across
    the scopes (`binding`), after this admission."""

    reservation: Reservation
    requests: WindowStatus
    tokens: WindowStatus


@dataclass(frozen=True, slots=True)
class Denied:
    """Refused; nothing was charged anywhere.

    scope_key: the scope whose check failed (scopes are checked in order; within one
    scope rpm, tpm, concurrency, budget). retry_after_s: when the window will have room
    (rpm, tpm) or a slot may free (concurrency, capped at CONCURRENCY_RETRY_HINT_S);
    None when waiting cannot help: a budget, or a request larger than the limit itself
    (tokens > tpm, rpm == 0, max_concurrent == 0). Statuses are the binding ones across
    the scopes (`binding`).
    """

    reason: DenyReason
    scope_key: str
    retry_after_s: float | None
    requests: WindowStatus
    tokens: WindowStatus


@dataclass(frozen=True, slots=True)
class SettleResult:
    """released: this call returned a live lease (its reserved cost and its slot).
    charged: this call charged the actual cost (False on a repeat, or when charge()
    already charged this id)."""

    released: bool
    charged: bool


@dataclass(frozen=True, slots=True)
class ScopeUsage:
    """Counters of one scope. reserved_micros counts live reservations of `period`."""

    spent_micros: int
    reserved_micros: int
    concurrent: int
    requests_in_window: int
    tokens_in_window: int
    # The window's timing, for the headers of a refusal made from usage (not compared):
    # seconds until it is empty again (x-ratelimit-reset-*) and until its oldest
    # admission leaves (a request's place frees: Retry-After).
    reset_s: float = field(default=0.0, compare=False)
    oldest_leaves_s: float = field(default=0.0, compare=False)


def window_timing(
    oldest_us: int, newest_us: int, now_us: int, window_us: int
) -> tuple[float, float]:
    """(reset_s, oldest_leaves_s) of a window from its oldest and newest admissions (-1:
    empty)."""
    if newest_us < 0:
        return 0.0, 0.0
    return max(0, newest_us + window_us - now_us) / 1e6, max(
        0, oldest_us + window_us - now_us
    ) / 1e6


Decision = Granted | Denied
"""What a reserve() answers."""


@runtime_checkable
class QuotaStore(Protocol):
    """The atomic check-and-reserve engine under admission. All methods are coroutines;
    each Redis operation is one round trip (expire_leases() excepted: it is a sweep)."""

    async def reserve(self, request: ReserveRequest) -> Decision:
        """Check every limit of every scope and, if all pass, charge them all at once.
        Repeating a reserve whose lease is live returns Granted without charging again;
        an id that was settled, or whose expired admission is still in the window,
        raises ReservationIdError."""
        ...

    async def renew(self, reservations: Sequence[Reservation], lease_s: float) -> set[str]:
        """Move the lease of each live reservation to now + lease_s, all in one call.
        Returns the ids renewed; an expired lease stays expired."""
        ...

    async def restore(self, reservations: Sequence[Reservation], lease_s: float) -> int:
        """Re-create, without checking limits, the lease (and reserved cost) of each
        reservation not settled yet whose lease the store no longer holds in a scope.
        Returns how many reservations got a lease back."""
        ...

    async def settle(
        self,
        reservation: Reservation,
        actual_tokens: int,
        actual_cost_micros: int,
        at_us: int | None = None,
    ) -> SettleResult:
        """Release the reservation and charge its actual cost once (idempotent). at_us:
        the ledger row's time (default now); older than the cutoff: marked, not added."""
        ...

    async def charge(
        self,
        charge_id: str,
        scope_keys: Sequence[str],
        period: str,
        cost_micros: int,
        at_us: int | None = None,
    ) -> bool:
        """Add cost_micros to spent in every scope, once per charge_id (the same marker
        as settle: a reservation id settled already is not charged again). True if this
        call charged (or marked a row older than the cutoff)."""
        ...

    async def begin_rebuild(self, period: str) -> str:
        """Start a rebuild of `period`; returns its token for finish_rebuild."""
        ...

    async def rebase(self, period: str, cutoff_us: int, bases: Mapping[str, int]) -> None:
        """For each scope: spent = its base (the ledger's rows older than cutoff_us) plus
        the charges taken for rows at or after it. A cutoff older than the scope's last
        one is ignored (a slower, concurrent rebuild)."""
        ...

    async def finish_rebuild(self, period: str, token: str, hold_s: float) -> bool:
        """Mark `period` known, unless the store lost the rebuild (came up empty since
        begin_rebuild): then False and nothing changes. A period that was not known is
        admitted only hold_s later, so every live gateway restore()s its leases first."""
        ...

    async def is_ready(self, period: str) -> bool:
        """Whether a rebuild of `period` finished since the store last came up empty."""
        ...

    async def charged(self, charge_ids: Sequence[str]) -> set[str]:
        """The ids among charge_ids that a settle or a charge already charged."""
        ...

    async def usage(self, scope_key: str, period: str) -> ScopeUsage:
        """Counters of one scope (expired leases released first)."""
        ...

    async def expire_leases(self) -> int:
        """Release every expired lease in every scope (the periodic sweep). Returns how
        many scope leases it released: a reservation over two scopes counts twice, and
        leases that an operation on their scope already released lazily are not counted."""
        ...

    async def aclose(self) -> None:
        """Release connections the store opened itself."""
        ...


def month_period(when: datetime | None = None) -> str:
    """The budget period of a monthly plan: "YYYY-MM" of `when` (default now) in UTC."""
    moment = (when or datetime.now(UTC)).astimezone(UTC)
    return f"{moment.year:04d}-{moment.month:02d}"


def window_status(
    limit: int | None, used: int, newest_us: int, now_us: int, window_us: int = WINDOW_US
) -> WindowStatus:
    """A WindowStatus from a window's usage and its newest admission (-1 when empty)."""
    reset_s = max(0, newest_us + window_us - now_us) / 1e6 if newest_us >= 0 else 0.0
    if limit is None:
        return WindowStatus(None, None, reset_s)
    return WindowStatus(limit, max(0, limit - used), reset_s)


def binding(statuses: Sequence[WindowStatus]) -> WindowStatus:
    """Of one window's statuses in several scopes (a tenant's and its key's), the one that
    binds: the fewest remaining (then the lowest limit); unlimited only if every scope is."""
    limited = [s for s in statuses if s.limit is not None and s.remaining is not None]
    if not limited:
        return statuses[0]
    return min(limited, key=lambda s: (s.remaining, s.limit))


def retry_after(reason: DenyReason, retry_us: int) -> float | None:
    """Seconds to wait from the raw wait in microseconds (-1: waiting cannot help)."""
    if retry_us < 0:
        return None
    seconds = max(0, retry_us) / 1e6
    if reason is DenyReason.CONCURRENCY:
        return min(seconds, CONCURRENCY_RETRY_HINT_S)
    return seconds
