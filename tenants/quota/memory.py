"""In-process quota store for the embedded default (one gateway process).

Each operation runs to completion without awaiting, so it is atomic with respect to
other tasks on the event loop; a short threading lock (never held across an await) also
makes it safe from several threads or loops. Per-scope state mirrors the Redis layout:

- window: admissions in order (time, id) with their tokens and a running total; entries
  leave from the left as they age past WINDOW_S.
- leases: id -> expiry, with a heap of (expiry, id) whose stale entries (renewed or
  settled leases) are skipped when they surface; held: id -> (cost, period).
- spent and reserved per period; per period too, the last rebase's cutoff and the
  charges taken since (id -> (row time, cost)), whose sum is `recent`.

The clock is injectable (a callable returning seconds) so tests move time without
sleeping; it is clamped to never run backwards.
"""

from __future__ import annotations

import heapq
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from tenants.quota.contract import (
    DEFAULT_SETTLED_TTL_S,
    WINDOW_S,
    Denied,
    DenyReason,
    Granted,
    Reservation,
    ReservationIdError,
    ReserveRequest,
    Scope,
    ScopeUsage,
    SettleResult,
    SpendUnknownError,
    WindowStatus,
    binding,
    check_charge,
    check_lease,
    check_rebase,
    check_settle,
    check_window,
    retry_after,
    wall_us,
    window_status,
    window_timing,
)


@dataclass(slots=True)
class _ScopeState:
    spent: dict[str, int] = field(default_factory=dict)
    reserved: dict[str, int] = field(default_factory=dict)
    leases: dict[str, int] = field(default_factory=dict)
    lease_heap: list[tuple[int, str]] = field(default_factory=list)
    held: dict[str, tuple[int, str]] = field(default_factory=dict)
    window: deque[tuple[int, str]] = field(default_factory=deque)
    window_tokens: dict[str, int] = field(default_factory=dict)
    tokens_total: int = 0
    cut: dict[str, int] = field(default_factory=dict)
    recent: dict[str, int] = field(default_factory=dict)
    charges: dict[str, dict[str, tuple[int, int]]] = field(default_factory=dict)

    def credit(self, period: str, charge_id: str, at_us: int, cost: int) -> None:
        """Charge a ledger row, unless the last rebase's base already holds it."""
        if at_us < self.cut.get(period, -1) or cost == 0:
            return
        self.spent[period] = self.spent.get(period, 0) + cost
        self.recent[period] = self.recent.get(period, 0) + cost
        self.charges.setdefault(period, {})[charge_id] = (at_us, cost)

    def rebase(self, period: str, cutoff_us: int, base: int) -> None:
        if cutoff_us < self.cut.get(period, -1):
            return  # a slower rebuild than the last one
        charges = self.charges.get(period, {})
        for charge_id in [c for c, (at, _) in charges.items() if at < cutoff_us]:
            self.recent[period] -= charges.pop(charge_id)[1]
        self.cut[period] = cutoff_us
        self.spent[period] = base + self.recent.get(period, 0)

    def hold(self, rid: str, expiry: int, cost: int, period: str) -> None:
        self.leases[rid] = expiry
        heapq.heappush(self.lease_heap, (expiry, rid))
        self.held[rid] = (cost, period)
        if cost:
            self.reserved[period] = self.reserved.get(period, 0) + cost

    def expire(self, now: int) -> int:
        """Release every lease whose expiry is <= now; returns how many."""
        released = 0
        heap = self.lease_heap
        while heap and heap[0][0] <= now:
            expiry, rid = heapq.heappop(heap)
            if self.leases.get(rid) == expiry:
                self.release(rid)
                released += 1
        return released

    def release(self, rid: str) -> bool:
        """Return the lease of `rid` (its reserved cost and its slot) if it is held."""
        if self.leases.pop(rid, None) is None:
            return False
        cost, period = self.held.pop(rid)
        left = self.reserved.get(period, 0) - cost
        if left:
            self.reserved[period] = left
        else:
            self.reserved.pop(period, None)
        return True

    def compact(self) -> None:
        """Drop stale heap entries (settled or renewed leases) once they dominate."""
        if len(self.lease_heap) > 2 * len(self.leases) + 64:
            self.lease_heap = [(e, r) for e, r in self.lease_heap if self.leases.get(r) == e]
            heapq.heapify(self.lease_heap)

    def prune_window(self, now: int, window_us: int) -> None:
        cutoff = now - window_us
        window = self.window
        while window and window[0][0] <= cutoff:
            _, rid = window.popleft()
            self.tokens_total -= self.window_tokens.pop(rid)

    def earliest_lease(self) -> int:
        heap = self.lease_heap
        while heap and self.leases.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)
        return heap[0][0]

    def tokens_retry(self, need: int, now: int, window_us: int) -> int:
        """Microseconds until enough admissions leave the window to free `need` tokens."""
        freed = 0
        for admitted, rid in self.window:
            freed += self.window_tokens[rid]
            if freed >= need:
                return admitted + window_us - now
        return window_us

    def newest(self) -> int:
        return self.window[-1][0] if self.window else -1


class MemoryQuotaStore:
    """The quota store contract in one process. `clock` returns seconds (monotonic)."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        settled_ttl_s: float = DEFAULT_SETTLED_TTL_S,
        window_s: float = WINDOW_S,
        guarded: bool = False,
    ) -> None:
        self._clock = clock
        self._guarded = guarded  # refuse reserve() until the period's spend is rebuilt
        self._ready: set[str] = set()
        self._rebuilds: set[str] = set()
        self._window_us = check_window(window_s)
        self._settled_ttl_us = int(settled_ttl_s * 1_000_000)
        self._lock = threading.Lock()
        self._last_now = 0
        self._scopes: dict[str, _ScopeState] = {}
        self._with_leases: set[str] = set()
        self._done: dict[str, int] = {}
        self._done_order: deque[tuple[int, str]] = deque()

    def _now(self) -> int:
        now = max(int(self._clock() * 1_000_000), self._last_now)
        self._last_now = now
        return now

    def _scope(self, key: str, now: int) -> _ScopeState:
        """The scope's state with expired leases released and the window pruned."""
        state = self._scopes.get(key)
        if state is None:
            state = self._scopes[key] = _ScopeState()
        state.expire(now)
        state.prune_window(now, self._window_us)
        if not state.leases:
            self._with_leases.discard(key)
        return state

    def _is_done(self, charge_id: str, now: int) -> bool:
        order = self._done_order
        while order and order[0][0] <= now:
            expiry, old = order.popleft()
            if self._done.get(old) == expiry:
                del self._done[old]
        return charge_id in self._done

    def _mark_done(self, charge_id: str, now: int) -> bool:
        if self._is_done(charge_id, now):
            return False
        expiry = now + self._settled_ttl_us
        self._done[charge_id] = expiry
        self._done_order.append((expiry, charge_id))
        return True

    def _statuses(
        self, scopes: Sequence[Scope], states: Sequence[_ScopeState], now: int
    ) -> tuple[WindowStatus, WindowStatus]:
        """The binding requests and tokens statuses of the scopes' windows, for the
        headers."""
        requests, tokens = [], []
        for scope, state in zip(scopes, states, strict=True):
            newest, limits = state.newest(), scope.limits
            requests.append(
                window_status(limits.rpm, len(state.window), newest, now, self._window_us)
            )
            tokens.append(
                window_status(limits.tpm, state.tokens_total, newest, now, self._window_us)
            )
        return binding(requests), binding(tokens)

    async def reserve(self, request: ReserveRequest) -> Granted | Denied:
        with self._lock:
            return self._reserve(request)

    def _reserve(self, request: ReserveRequest) -> Granted | Denied:
        rid = request.reservation_id
        now = self._now()
        if self._guarded and request.period not in self._ready:
            raise SpendUnknownError(request.period, 1.0)
        if self._is_done(rid, now):
            raise ReservationIdError(f"reservation {rid!r} was already settled")
        states = [self._scope(scope.key, now) for scope in request.scopes]
        first = states[0]
        if rid in first.leases:
            return Granted(request.reservation, *self._statuses(request.scopes, states, now))
        if rid in first.window_tokens:
            raise ReservationIdError(f"reservation {rid!r} expired and is still in the window")
        tokens, cost, period = request.tokens, request.cost_micros, request.period
        window_us = self._window_us
        for scope, state in zip(request.scopes, states, strict=True):
            limits = scope.limits
            reason: DenyReason | None = None
            retry_us = -1
            count = len(state.window)
            if limits.rpm is not None and count >= limits.rpm:
                reason = DenyReason.RPM
                if limits.rpm > 0:
                    retry_us = state.window[count - limits.rpm][0] + window_us - now
            elif limits.tpm is not None and state.tokens_total + tokens > limits.tpm:
                reason = DenyReason.TPM
                if tokens <= limits.tpm:
                    need = state.tokens_total + tokens - limits.tpm
                    retry_us = state.tokens_retry(need, now, window_us)
            elif limits.max_concurrent is not None and len(state.leases) >= limits.max_concurrent:
                reason = DenyReason.CONCURRENCY
                if limits.max_concurrent > 0:
                    retry_us = state.earliest_lease() - now
            elif limits.budget_micros is not None and (
                state.spent.get(period, 0) + state.reserved.get(period, 0) + cost
                > limits.budget_micros
            ):
                reason = DenyReason.BUDGET
            if reason is not None:
                return Denied(
                    reason,
                    scope.key,
                    retry_after(reason, retry_us),
                    *self._statuses(request.scopes, states, now),
                )
        expiry = now + check_lease(request.lease_s)
        for scope, state in zip(request.scopes, states, strict=True):
            state.window.append((now, rid))
            state.window_tokens[rid] = tokens
            state.tokens_total += tokens
            state.hold(rid, expiry, cost, period)
            self._with_leases.add(scope.key)
        return Granted(request.reservation, *self._statuses(request.scopes, states, now))

    async def renew(self, reservations: Sequence[Reservation], lease_s: float) -> set[str]:
        lease_us = check_lease(lease_s)
        with self._lock:
            now = self._now()
            expiry = now + lease_us
            renewed: set[str] = set()
            for reservation in reservations:
                rid = reservation.reservation_id
                for index, key in enumerate(reservation.scope_keys):
                    state = self._scopes.get(key)
                    if state is None or state.leases.get(rid, -1) <= now:
                        continue
                    state.leases[rid] = expiry
                    heapq.heappush(state.lease_heap, (expiry, rid))
                    state.compact()
                    if index == 0:
                        renewed.add(rid)
            return renewed

    async def restore(self, reservations: Sequence[Reservation], lease_s: float) -> int:
        lease_us = check_lease(lease_s)
        with self._lock:
            now = self._now()
            restored = 0
            for r in reservations:
                if self._is_done(r.reservation_id, now):
                    continue
                missing = [
                    key
                    for key in r.scope_keys
                    if r.reservation_id not in self._scope(key, now).leases
                ]
                for key in missing:
                    self._scopes[key].hold(
                        r.reservation_id, now + lease_us, r.cost_micros, r.period
                    )
                    self._with_leases.add(key)
                restored += bool(missing)
            return restored

    async def settle(
        self,
        reservation: Reservation,
        actual_tokens: int,
        actual_cost_micros: int,
        at_us: int | None = None,
    ) -> SettleResult:
        check_settle(actual_tokens, actual_cost_micros)
        at = wall_us() if at_us is None else at_us
        with self._lock:
            rid, period = reservation.reservation_id, reservation.period
            now = self._now()
            states = [self._scope(key, now) for key in reservation.scope_keys]
            released = False
            for key, state in zip(reservation.scope_keys, states, strict=True):
                released = state.release(rid) or released
                state.compact()
                if not state.leases:
                    self._with_leases.discard(key)
            charged = self._mark_done(rid, now)
            if released or charged:
                for state in states:
                    old = state.window_tokens.get(rid)
                    if old is not None:
                        state.window_tokens[rid] = actual_tokens
                        state.tokens_total += actual_tokens - old
                    if charged:
                        state.credit(period, rid, at, actual_cost_micros)
            return SettleResult(released, charged)

    async def charge(
        self,
        charge_id: str,
        scope_keys: Sequence[str],
        period: str,
        cost_micros: int,
        at_us: int | None = None,
    ) -> bool:
        check_charge(charge_id, scope_keys, period, cost_micros)
        at = wall_us() if at_us is None else at_us
        with self._lock:
            now = self._now()
            if not self._mark_done(charge_id, now):
                return False
            for key in scope_keys:
                self._scopes.setdefault(key, _ScopeState()).credit(
                    period, charge_id, at, cost_micros
                )
            return True

    async def begin_rebuild(self, period: str) -> str:
        token = uuid.uuid4().hex
        with self._lock:
            self._rebuilds.add(token)
        return token

    async def rebase(self, period: str, cutoff_us: int, bases: Mapping[str, int]) -> None:
        check_rebase(period, cutoff_us, bases)
        with self._lock:
            for key, base in bases.items():
                self._scopes.setdefault(key, _ScopeState()).rebase(period, cutoff_us, base)

    async def finish_rebuild(self, period: str, token: str, hold_s: float) -> bool:
        """hold_s is moot here: the only gateway is this process, which restores nothing."""
        with self._lock:
            if token not in self._rebuilds:
                return False
            self._rebuilds.discard(token)
            self._ready.add(period)
            return True

    async def is_ready(self, period: str) -> bool:
        with self._lock:
            return period in self._ready

    async def charged(self, charge_ids: Sequence[str]) -> set[str]:
        with self._lock:
            now = self._now()
            return {cid for cid in charge_ids if self._is_done(cid, now)}

    async def usage(self, scope_key: str, period: str) -> ScopeUsage:
        with self._lock:
            now = self._now()
            state = self._scope(scope_key, now)
            usage = ScopeUsage(
                spent_micros=state.spent.get(period, 0),
                reserved_micros=state.reserved.get(period, 0),
                concurrent=len(state.leases),
                requests_in_window=len(state.window),
                tokens_in_window=state.tokens_total,
            )
            oldest = state.window[0][0] if state.window else -1
            reset_s, leaves_s = window_timing(oldest, state.newest(), now, self._window_us)
            return replace(usage, reset_s=reset_s, oldest_leaves_s=leaves_s)

    async def expire_leases(self) -> int:
        with self._lock:
            now = self._now()
            released = 0
            for key in list(self._with_leases):
                state = self._scopes[key]
                released += state.expire(now)
                if not state.leases:
                    self._with_leases.discard(key)
            return released

    async def aclose(self) -> None:
        return None
