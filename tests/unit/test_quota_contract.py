"""The quota store contract, checked against both implementations.

A hypothesis state machine drives a store and a brute-force model of the contract side
by side and compares every outcome and every counter. The memory store runs on a fake
clock, so the machine also moves time (windows age, leases expire, the sweep runs).
Redis time cannot be faked: against Redis the machine keeps time-dependent rules off
and uses leases far longer than an example lasts (real expiry is covered with short
real leases in tests/integration/test_quota_redis.py). Redis runs on 127.0.0.1:6379;
each example uses its own key prefix and deletes its keys afterwards.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)
from redis.asyncio import Redis

from tenants.quota import (
    CONCURRENCY_RETRY_HINT_S,
    Denied,
    DenyReason,
    Granted,
    Limits,
    MemoryQuotaStore,
    QuotaStore,
    RedisQuotaStore,
    Reservation,
    ReservationIdError,
    ReserveRequest,
    Scope,
    ScopeUsage,
    SettleResult,
    SpendUnknownError,
    WindowStatus,
    month_period,
    open_quota_store,
)
from tenants.quota.contract import WINDOW_US, binding, check_lease
from tests.conftest import REDIS_URL

PERIODS = ("2026-10", "2026-11")
SCOPE_KEYS = ("tenant:t", "key:a", "key:b")
SCOPE_SETS = (("tenant:t",), ("key:a", "tenant:t"), ("tenant:t", "key:b"), ("key:a",))
T = TypeVar("T")


class FakeClock:
    """Seconds, moved by the test. Time is kept in integer microseconds."""

    def __init__(self, start_us: int = 1_000_000_000) -> None:
        self.us = start_us

    def __call__(self) -> float:
        return self.us / 1_000_000

    def advance(self, seconds: float) -> None:
        self.us += int(seconds * 1_000_000)


async def delete_prefix(client: Redis, prefix: str) -> None:
    keys = [key async for key in client.scan_iter(match=f"{prefix}*", count=500)]
    if keys:
        await client.delete(*keys)


# ---------------------------------------------------------------------------------------
# The model: the contract written as plainly as possible (lists and sums, no indexes).


@dataclass
class ModelReservation:
    rid: str
    scopes: tuple[str, ...]
    period: str
    tokens: int
    cost: int
    admitted: int
    expiry: int
    released: bool = False

    @property
    def handle(self) -> Reservation:
        return Reservation(self.rid, self.scopes, self.period)


@dataclass
class Expected:
    """What the model says reserve() returns."""

    kind: str  # "granted", "again" (idempotent repeat), "denied", "error"
    reason: DenyReason | None = None
    scope_key: str | None = None
    retry_us: int = -1


@dataclass
class Model:
    limits: dict[str, Limits]
    reservations: dict[str, ModelReservation] = field(default_factory=dict)
    done: set[str] = field(default_factory=set)
    spent: dict[tuple[str, str], int] = field(default_factory=dict)
    # Charged without a live reservation behind it (late settles, reconciler charges):
    # the only way spent + reserved may exceed a budget.
    overdraft: dict[tuple[str, str], int] = field(default_factory=dict)
    actual_costs: int = 0

    def live(self, r: ModelReservation, now: int) -> bool:
        return not r.released and r.expiry > now

    def window(self, scope: str, now: int) -> list[ModelReservation]:
        entries = [
            r
            for r in self.reservations.values()
            if scope in r.scopes and r.admitted > now - WINDOW_US
        ]
        return sorted(entries, key=lambda r: r.admitted)

    def leases(self, scope: str, now: int) -> list[ModelReservation]:
        return [r for r in self.reservations.values() if scope in r.scopes and self.live(r, now)]

    def reserved(self, scope: str, period: str, now: int) -> int:
        return sum(r.cost for r in self.leases(scope, now) if r.period == period)

    def usage(self, scope: str, period: str, now: int) -> ScopeUsage:
        window = self.window(scope, now)
        return ScopeUsage(
            spent_micros=self.spent.get((scope, period), 0),
            reserved_micros=self.reserved(scope, period, now),
            concurrent=len(self.leases(scope, now)),
            requests_in_window=len(window),
            tokens_in_window=sum(r.tokens for r in window),
        )

    def status(self, scope: str, now: int) -> tuple[WindowStatus, WindowStatus]:
        window = self.window(scope, now)
        newest = window[-1].admitted if window else -1
        reset = max(0, newest + WINDOW_US - now) / 1e6 if window else 0.0
        limits = self.limits[scope]
        used = (len(window), sum(r.tokens for r in window))
        out = []
        for limit, count in ((limits.rpm, used[0]), (limits.tpm, used[1])):
            if limit is None:
                out.append(WindowStatus(None, None, reset))
            else:
                out.append(WindowStatus(limit, max(0, limit - count), reset))
        return out[0], out[1]

    def predict(self, request: ReserveRequest, now: int) -> Expected:
        rid = request.reservation_id
        first = request.scopes[0].key
        known = self.reservations.get(rid)
        if rid in self.done:
            return Expected("error")
        if known is not None and first in known.scopes and self.live(known, now):
            return Expected("again")
        if known is not None and first in known.scopes and known.admitted > now - WINDOW_US:
            return Expected("error")
        for scope in request.scopes:
            limits, key = scope.limits, scope.key
            window = self.window(key, now)
            tokens_in = sum(r.tokens for r in window)
            leases = self.leases(key, now)
            if limits.rpm is not None and len(window) >= limits.rpm:
                retry = -1
                if limits.rpm > 0:
                    retry = window[len(window) - limits.rpm].admitted + WINDOW_US - now
                return Expected("denied", DenyReason.RPM, key, retry)
            if limits.tpm is not None and tokens_in + request.tokens > limits.tpm:
                retry = -1
                if request.tokens <= limits.tpm:
                    need, freed = tokens_in + request.tokens - limits.tpm, 0
                    for r in window:
                        freed += r.tokens
                        if freed >= need:
                            retry = r.admitted + WINDOW_US - now
                            break
                return Expected("denied", DenyReason.TPM, key, retry)
            if limits.max_concurrent is not None and len(leases) >= limits.max_concurrent:
                retry = -1
                if limits.max_concurrent > 0:
                    retry = min(r.expiry for r in leases) - now
                return Expected("denied", DenyReason.CONCURRENCY, key, retry)
            budget = limits.budget_micros
            spent = self.spent.get((key, request.period), 0)
            if budget is not None and (
                spent + self.reserved(key, request.period, now) + request.cost_micros > budget
            ):
                return Expected("denied", DenyReason.BUDGET, key)
        return Expected("granted")

    def grant(self, request: ReserveRequest, now: int) -> ModelReservation:
        r = ModelReservation(
            request.reservation_id,
            tuple(s.key for s in request.scopes),
            request.period,
            request.tokens,
            request.cost_micros,
            admitted=now,
            expiry=now + check_lease(request.lease_s),
        )
        known = self.reservations.get(r.rid)
        if known is None:
            self.reservations[r.rid] = r
            return r
        # An id reused after its lease expired and its admission left the window: the
        # bundle holds the old object, so it becomes the new reservation in place.
        known.__dict__.update(r.__dict__)
        return known

    def settle(self, r: ModelReservation, tokens: int, cost: int, now: int) -> SettleResult:
        released = self.live(r, now)
        r.released = r.released or released
        charged = r.rid not in self.done
        if charged:
            self.done.add(r.rid)
            self.actual_costs += cost
            for scope in r.scopes:
                self.spent[scope, r.period] = self.spent.get((scope, r.period), 0) + cost
                if not released:
                    self.overdraft[scope, r.period] = (
                        self.overdraft.get((scope, r.period), 0) + cost
                    )
        if (released or charged) and r.admitted > now - WINDOW_US:
            r.tokens = tokens
        return SettleResult(released, charged)

    def charge(self, charge_id: str, scopes: tuple[str, ...], period: str, cost: int) -> bool:
        if charge_id in self.done:
            return False
        self.done.add(charge_id)
        self.actual_costs += cost
        for scope in scopes:
            self.spent[scope, period] = self.spent.get((scope, period), 0) + cost
            self.overdraft[scope, period] = self.overdraft.get((scope, period), 0) + cost
        return True


# ---------------------------------------------------------------------------------------
# The state machine.

# Tight limits (denials, "never fits") and roomy ones (long runs of grants and settles).
rpm_limits = st.one_of(st.none(), st.integers(0, 3), st.integers(4, 20))
tpm_limits = st.one_of(st.none(), st.integers(0, 60), st.integers(60, 400))
concurrency_limits = st.one_of(st.none(), st.integers(0, 2), st.integers(2, 8))
budget_limits = st.one_of(st.none(), st.integers(0, 500), st.integers(500, 5000))
limits_strategy = st.builds(
    Limits,
    rpm=rpm_limits,
    tpm=tpm_limits,
    max_concurrent=concurrency_limits,
    budget_micros=budget_limits,
)


class QuotaMachine(RuleBasedStateMachine):
    reservations = Bundle("reservations")

    kind = "memory"

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.clock = FakeClock()
        self.client: Redis | None = None
        self.prefix = f"tgtest:quota:{uuid.uuid4().hex}:"
        self.store: QuotaStore
        if self.kind == "memory":
            self.store = MemoryQuotaStore(clock=self.clock)
        else:
            self.client = Redis.from_url(REDIS_URL)
            self.store = RedisQuotaStore(self.client, prefix=self.prefix)
        self.model = Model({})
        self.counter = 0
        self.lease_s = 3600.0

    @property
    def timed(self) -> bool:
        return self.kind == "memory"

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coroutine)

    def now(self) -> int:
        """The model's clock: the fake clock as the store reads it, or a frozen 0 on Redis
        (an example lasts far less than the window and the leases it uses)."""
        return int(self.clock() * 1_000_000) if self.timed else 0

    @initialize(tenant=limits_strategy, key_a=limits_strategy, key_b=limits_strategy)
    def configure(self, tenant: Limits, key_a: Limits, key_b: Limits) -> None:
        self.model.limits = {"tenant:t": tenant, "key:a": key_a, "key:b": key_b}

    def request(
        self, rid: str, scopes: tuple[str, ...], tokens: int, cost: int, period: str, lease_s: float
    ) -> ReserveRequest:
        return ReserveRequest(
            rid,
            tuple(Scope(key, self.model.limits[key]) for key in scopes),
            tokens,
            cost,
            period,
            lease_s,
        )

    def do_reserve(self, request: ReserveRequest) -> ModelReservation | None:
        now = self.now()
        expected = self.model.predict(request, now)
        event(f"reserve: {expected.kind} {expected.reason or ''}".strip())
        if expected.kind == "error":
            with pytest.raises(ReservationIdError):
                self.run(self.store.reserve(request))
            return None
        outcome = self.run(self.store.reserve(request))
        if expected.kind == "denied":
            assert isinstance(outcome, Denied), (expected, outcome)
            assert (outcome.reason, outcome.scope_key) == (expected.reason, expected.scope_key)
            if expected.retry_us < 0:
                assert outcome.retry_after_s is None
            elif self.timed:
                seconds = expected.retry_us / 1e6
                if expected.reason is DenyReason.CONCURRENCY:
                    seconds = min(seconds, CONCURRENCY_RETRY_HINT_S)
                assert outcome.retry_after_s == seconds
            else:
                assert outcome.retry_after_s is not None
                assert 0 < outcome.retry_after_s <= 60
            self.check_status(request, outcome.requests, outcome.tokens, now)
            return None
        assert isinstance(outcome, Granted), (expected, outcome)
        assert outcome.reservation == request.reservation
        if expected.kind == "again":
            return None
        granted = self.model.grant(request, now)
        self.check_status(request, outcome.requests, outcome.tokens, now)
        return granted

    def check_status(
        self, request: ReserveRequest, requests: WindowStatus, tokens: WindowStatus, now: int
    ) -> None:
        """The headers' statuses are the binding ones over the request's scopes."""
        statuses = [self.model.status(scope.key, now) for scope in request.scopes]
        want_requests = binding([status[0] for status in statuses])
        want_tokens = binding([status[1] for status in statuses])
        if self.timed:
            assert (requests, tokens) == (want_requests, want_tokens)
        else:
            got = (requests.limit, requests.remaining, tokens.limit, tokens.remaining)
            want = (
                want_requests.limit,
                want_requests.remaining,
                want_tokens.limit,
                want_tokens.remaining,
            )
            assert got == want
            assert 0 <= requests.reset_s <= 60
            assert 0 <= tokens.reset_s <= 60

    @rule(
        target=reservations,
        scopes=st.sampled_from(SCOPE_SETS),
        tokens=st.integers(0, 60),
        cost=st.integers(0, 400),
        period=st.sampled_from(PERIODS),
        lease_s=st.sampled_from([0.5, 2.0, 30.0]),
    )
    def reserve(
        self, scopes: tuple[str, ...], tokens: int, cost: int, period: str, lease_s: float
    ) -> Any:
        self.counter += 1
        if not self.timed:
            lease_s = self.lease_s
        granted = self.do_reserve(
            self.request(f"r{self.counter}", scopes, tokens, cost, period, lease_s)
        )
        return multiple() if granted is None else granted

    @rule(
        target=reservations,
        scopes=st.sampled_from(SCOPE_SETS),
        tokens=st.integers(0, 10),
        cost=st.integers(0, 50),
        period=st.sampled_from(PERIODS),
    )
    def reserve_small(self, scopes: tuple[str, ...], tokens: int, cost: int, period: str) -> Any:
        return self.reserve(scopes, tokens, cost, period, 2.0)

    @rule(
        target=reservations,
        scopes=st.sampled_from(SCOPE_SETS),
        period=st.sampled_from(PERIODS),
        overshoot=st.sampled_from([0, 1]),
    )
    def reserve_to_the_limit(self, scopes: tuple[str, ...], period: str, overshoot: int) -> Any:
        """Ask for exactly what the first scope has left (or one more): the boundaries."""
        now = self.now()
        limits = self.model.limits[scopes[0]]
        left = self.model.usage(scopes[0], period, now)
        tokens, cost = 5, 10
        if limits.tpm is not None:
            tokens = max(0, limits.tpm - left.tokens_in_window) + overshoot
        if limits.budget_micros is not None:
            used = left.spent_micros + left.reserved_micros
            cost = max(0, limits.budget_micros - used) + overshoot
        return self.reserve(scopes, tokens, cost, period, 2.0)

    @rule(r=reservations)
    def reserve_again(self, r: ModelReservation) -> None:
        """A retry of a reserve whose reply was lost: granted again without a new charge
        while the lease is live; refused once settled."""
        self.do_reserve(
            self.request(
                r.rid, r.scopes, r.tokens, r.cost, r.period, 30.0 if self.timed else 3600.0
            )
        )

    @rule(r=reservations, data=st.data())
    def settle(self, r: ModelReservation, data: st.DataObject) -> None:
        tokens = data.draw(st.integers(0, r.tokens), label="actual_tokens")
        cost = data.draw(st.integers(0, r.cost), label="actual_cost")
        expected = self.model.settle(r, tokens, cost, self.now())
        event(f"settle: released={expected.released} charged={expected.charged}")
        assert self.run(self.store.settle(r.handle, tokens, cost)) == expected

    @rule(r=reservations, cost=st.integers(0, 300))
    def reconcile(self, r: ModelReservation, cost: int) -> None:
        """The reconciler charges a ledger row under the reservation's id: at most once,
        and never on top of a settle of the same id."""
        expected = self.model.charge(r.rid, r.scopes, r.period, cost)
        assert self.run(self.store.charge(r.rid, list(r.scopes), r.period, cost)) == expected

    @rule(
        scopes=st.sampled_from(SCOPE_SETS),
        period=st.sampled_from(PERIODS),
        cost=st.integers(0, 300),
        repeat=st.booleans(),
    )
    def charge(self, scopes: tuple[str, ...], period: str, cost: int, repeat: bool) -> None:
        self.counter += 1
        charge_id = f"c{self.counter}"
        for _ in range(2 if repeat else 1):
            expected = self.model.charge(charge_id, scopes, period, cost)
            assert self.run(self.store.charge(charge_id, list(scopes), period, cost)) == expected

    @rule(ids=st.lists(st.integers(1, 40), max_size=6))
    def charged(self, ids: list[int]) -> None:
        names = [f"{p}{i}" for i in ids for p in ("r", "c")]
        assert self.run(self.store.charged(names)) == {n for n in names if n in self.model.done}

    @rule(picked=st.lists(reservations, max_size=4, unique_by=lambda r: r.rid))
    def renew(self, picked: list[ModelReservation]) -> None:
        chosen = picked
        now = self.now()
        lease_s = 2.0 if self.timed else self.lease_s
        live = {r.rid for r in chosen if self.model.live(r, now)}
        assert self.run(self.store.renew([r.handle for r in chosen], lease_s)) == live
        for r in chosen:
            if r.rid in live:
                r.expiry = now + check_lease(lease_s)

    @precondition(lambda self: self.timed)
    @rule(
        seconds=st.one_of(st.sampled_from([0.001, 0.5, 2.0, 30.0, 60.0]), st.floats(0, 90)),
        sweep=st.booleans(),
    )
    def advance_time(self, seconds: float, sweep: bool) -> None:
        before = self.now()
        self.clock.advance(seconds)
        if sweep:
            now = self.now()
            # Every scope was visited by the invariant check at `before`, so the sweep
            # releases exactly the (scope, lease) pairs that expired since.
            expected = sum(
                len(r.scopes)
                for r in self.model.reservations.values()
                if not r.released and before < r.expiry <= now
            )
            event(f"sweep released {'some' if expected else 'none'}")
            assert self.run(self.store.expire_leases()) == expected

    def settle_everything(self) -> None:
        """Settle every reservation (at the end of each run): nothing stays reserved, no
        slot stays taken, and spent is exactly the sum of the actual costs charged."""
        for r in list(self.model.reservations.values()):
            expected = self.model.settle(r, r.tokens, r.cost // 2, self.now())
            assert self.run(self.store.settle(r.handle, r.tokens, r.cost // 2)) == expected
        total_spent = 0
        for scope in SCOPE_KEYS:
            for period in PERIODS:
                got = self.run(self.store.usage(scope, period))
                assert (got.reserved_micros, got.concurrent) == (0, 0)
                total_spent += got.spent_micros
        assert total_spent == sum(self.model.spent.values())

    @invariant()
    def counters_match_the_model(self) -> None:
        if not self.model.limits:
            return
        now = self.now()
        for scope in SCOPE_KEYS:
            limits = self.model.limits[scope]
            for period in PERIODS:
                got = self.run(self.store.usage(scope, period))
                assert got == self.model.usage(scope, period, now), (scope, period)
                if limits.budget_micros is not None:
                    overdraft = self.model.overdraft.get((scope, period), 0)
                    assert (
                        got.spent_micros + got.reserved_micros <= limits.budget_micros + overdraft
                    )
                if limits.tpm is not None:
                    assert got.tokens_in_window <= limits.tpm
                if limits.rpm is not None:
                    assert got.requests_in_window <= limits.rpm
                if limits.max_concurrent is not None:
                    assert got.concurrent <= limits.max_concurrent

    @invariant()
    def no_window_ever_exceeds_tpm(self) -> None:
        """Over the whole history: the tokens of the admissions within any WINDOW_S
        (windows ending at each admission are the fullest) fit the limit."""
        for scope in SCOPE_KEYS:
            tpm = self.model.limits.get(scope, Limits()).tpm
            if tpm is None:
                continue
            admitted = [r for r in self.model.reservations.values() if scope in r.scopes]
            for end in admitted:
                inside = [
                    r for r in admitted if end.admitted - WINDOW_US < r.admitted <= end.admitted
                ]
                assert sum(r.tokens for r in inside) <= tpm

    def teardown(self) -> None:
        try:
            if self.model.limits:
                self.settle_everything()
        finally:
            if self.client is not None:
                self.run(delete_prefix(self.client, self.prefix))
                self.run(self.client.aclose())
            self.loop.close()


class MemoryQuotaMachine(QuotaMachine):
    kind = "memory"


class RedisQuotaMachine(QuotaMachine):
    kind = "redis"


@pytest.mark.parametrize(
    ("machine", "examples"),
    [
        pytest.param(MemoryQuotaMachine, 150, id="memory"),
        pytest.param(RedisQuotaMachine, 50, id="redis", marks=pytest.mark.integration),
    ],
)
def test_store_keeps_the_contract(machine: type[QuotaMachine], examples: int) -> None:
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=examples,
            stateful_step_count=50,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


# ---------------------------------------------------------------------------------------
# Focused tests of the same contract on both stores.


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.integration)])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[QuotaStore]:
    if request.param == "memory":
        yield MemoryQuotaStore()
        return
    client = Redis.from_url(REDIS_URL)
    prefix = f"tgtest:quota:{uuid.uuid4().hex}:"
    try:
        yield RedisQuotaStore(client, prefix=prefix)
    finally:
        await delete_prefix(client, prefix)
        await client.aclose()


def reserve_request(
    rid: str, *scopes: Scope, tokens: int = 10, cost: int = 100, lease_s: float = 60.0
) -> ReserveRequest:
    return ReserveRequest(rid, scopes, tokens, cost, "2026-11", lease_s)


async def test_all_scopes_pass_or_nothing_is_charged(store: QuotaStore) -> None:
    tenant = Scope("tenant:t", Limits(rpm=10, tpm=1000, max_concurrent=10, budget_micros=10_000))
    key = Scope("key:k", Limits(budget_micros=150))
    assert isinstance(await store.reserve(reserve_request("a", tenant, key)), Granted)
    denied = await store.reserve(reserve_request("b", tenant, key))
    assert isinstance(denied, Denied)
    assert (denied.reason, denied.scope_key, denied.retry_after_s) == (
        DenyReason.BUDGET,
        "key:k",
        None,
    )
    assert await store.usage("tenant:t", "2026-11") == ScopeUsage(0, 100, 1, 1, 10)
    assert await store.usage("key:k", "2026-11") == ScopeUsage(0, 100, 1, 1, 10)


async def test_granted_carries_the_first_scopes_headers(store: QuotaStore) -> None:
    tenant = Scope("tenant:t", Limits(rpm=5, tpm=100))
    granted = await store.reserve(reserve_request("a", tenant, tokens=30))
    assert isinstance(granted, Granted)
    assert granted.requests == WindowStatus(5, 4, 60.0)
    assert granted.tokens == WindowStatus(100, 70, 60.0)
    unlimited = await store.reserve(reserve_request("b", Scope("key:k", Limits()), tokens=30))
    assert isinstance(unlimited, Granted)
    assert (unlimited.requests.limit, unlimited.requests.remaining) == (None, None)


async def test_limits_that_waiting_cannot_satisfy_have_no_retry(store: QuotaStore) -> None:
    too_big = await store.reserve(reserve_request("a", Scope("t", Limits(tpm=50)), tokens=51))
    assert isinstance(too_big, Denied)
    assert (too_big.reason, too_big.retry_after_s) == (DenyReason.TPM, None)
    closed = await store.reserve(reserve_request("b", Scope("t2", Limits(max_concurrent=0))))
    assert isinstance(closed, Denied)
    assert (closed.reason, closed.retry_after_s) == (DenyReason.CONCURRENCY, None)


async def test_settle_is_idempotent_and_charges_once(store: QuotaStore) -> None:
    scope = Scope("tenant:t", Limits(tpm=100, budget_micros=1000))
    granted = await store.reserve(reserve_request("a", scope, tokens=80, cost=600))
    assert isinstance(granted, Granted)
    assert await store.settle(granted.reservation, 20, 250) == SettleResult(True, True)
    assert await store.settle(granted.reservation, 80, 600) == SettleResult(False, False)
    assert await store.usage("tenant:t", "2026-11") == ScopeUsage(250, 0, 0, 1, 20)
    assert await store.charged(["a", "zz"]) == {"a"}
    assert not await store.charge("a", ["tenant:t"], "2026-11", 250)
    with pytest.raises(ReservationIdError):
        await store.reserve(reserve_request("a", scope))


async def test_reconciler_charge_then_settle_releases_without_charging(store: QuotaStore) -> None:
    scope = Scope("tenant:t", Limits(budget_micros=1000))
    granted = await store.reserve(reserve_request("a", scope, cost=600))
    assert isinstance(granted, Granted)
    assert await store.charge("a", ["tenant:t"], "2026-11", 300)
    assert await store.settle(granted.reservation, 5, 300) == SettleResult(True, False)
    assert await store.usage("tenant:t", "2026-11") == ScopeUsage(300, 0, 0, 1, 5)


async def test_reserve_repeated_while_live_is_granted_once(store: QuotaStore) -> None:
    scope = Scope("tenant:t", Limits(max_concurrent=1))
    first = await store.reserve(reserve_request("a", scope))
    again = await store.reserve(reserve_request("a", scope))
    assert isinstance(first, Granted)
    assert isinstance(again, Granted)
    assert await store.usage("tenant:t", "2026-11") == ScopeUsage(0, 100, 1, 1, 10)


async def test_budgets_are_per_period(store: QuotaStore) -> None:
    scope = Scope("tenant:t", Limits(budget_micros=100))
    october = ReserveRequest("a", (scope,), 1, 100, "2026-10", 60.0)
    november = ReserveRequest("b", (scope,), 1, 100, "2026-11", 60.0)
    assert isinstance(await store.reserve(october), Granted)
    assert isinstance(await store.reserve(november), Granted)
    assert (await store.usage("tenant:t", "2026-10")).reserved_micros == 100
    assert (await store.usage("tenant:t", "2026-11")).reserved_micros == 100


async def test_open_quota_store_picks_the_implementation() -> None:
    memory = open_quota_store(None)
    assert isinstance(memory, MemoryQuotaStore)
    assert isinstance(memory, QuotaStore)
    prefix = f"tgtest:quota:{uuid.uuid4().hex}:"
    shared = open_quota_store(REDIS_URL, prefix=prefix)
    assert isinstance(shared, RedisQuotaStore)
    assert isinstance(shared, QuotaStore)
    assert shared.prefix == prefix
    await shared.aclose()


def test_requests_are_validated() -> None:
    scope = Scope("tenant:t", Limits())
    with pytest.raises(ValueError, match="scopes"):
        ReserveRequest("a", (), 1, 1, "2026-11", 1.0)
    with pytest.raises(ValueError, match="duplicate"):
        ReserveRequest("a", (scope, scope), 1, 1, "2026-11", 1.0)
    with pytest.raises(ValueError, match="tokens"):
        ReserveRequest("a", (scope,), -1, 1, "2026-11", 1.0)
    with pytest.raises(TypeError, match="cost_micros"):
        ReserveRequest("a", (scope,), 1, 1.5, "2026-11", 1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="2\\*\\*53"):
        ReserveRequest("a", (scope,), 1, 2**60, "2026-11", 1.0)
    with pytest.raises(ValueError, match="period"):
        ReserveRequest("a", (scope,), 1, 1, "2026 11", 1.0)
    with pytest.raises(ValueError, match="lease_s"):
        ReserveRequest("a", (scope,), 1, 1, "2026-11", 0.0)
    with pytest.raises(ValueError, match="rpm"):
        Limits(rpm=-1)
    with pytest.raises(ValueError, match="scope key"):
        Scope("", Limits())


def test_month_period_is_utc_year_and_month() -> None:
    from datetime import datetime, timedelta, timezone

    east = timezone(timedelta(hours=3))
    assert month_period(datetime(2026, 12, 1, 1, 30, tzinfo=east)) == "2026-11"
    assert len(month_period()) == 7


# ---------------------------------------------------------------------------------------
# Time on the memory store's fake clock.


def memory_store() -> tuple[MemoryQuotaStore, FakeClock]:
    clock = FakeClock()
    return MemoryQuotaStore(clock=clock), clock


async def test_tpm_window_slides_admission_by_admission() -> None:
    store, clock = memory_store()
    scope = Scope("tenant:t", Limits(tpm=100))
    assert isinstance(await store.reserve(reserve_request("a", scope, tokens=60)), Granted)
    clock.advance(30)
    assert isinstance(await store.reserve(reserve_request("b", scope, tokens=40)), Granted)
    denied = await store.reserve(reserve_request("c", scope, tokens=50))
    assert isinstance(denied, Denied)
    assert (denied.reason, denied.retry_after_s) == (DenyReason.TPM, 30.0)
    assert denied.tokens == WindowStatus(100, 0, 60.0)
    clock.advance(29.999999)
    assert isinstance(await store.reserve(reserve_request("c", scope, tokens=50)), Denied)
    clock.advance(0.000001)  # "a" is exactly 60 s old: it has left the window
    assert isinstance(await store.reserve(reserve_request("c", scope, tokens=50)), Granted)
    assert (await store.usage("tenant:t", "2026-11")).tokens_in_window == 90


async def test_settle_puts_actual_tokens_in_the_window() -> None:
    store, _ = memory_store()
    scope = Scope("tenant:t", Limits(tpm=100))
    granted = await store.reserve(reserve_request("a", scope, tokens=90))
    assert isinstance(granted, Granted)
    assert isinstance(await store.reserve(reserve_request("b", scope, tokens=50)), Denied)
    await store.settle(granted.reservation, 10, 1)
    assert isinstance(await store.reserve(reserve_request("b", scope, tokens=50)), Granted)


async def test_expired_lease_returns_budget_and_slot_and_late_settle_still_charges() -> None:
    store, clock = memory_store()
    scope = Scope("tenant:t", Limits(max_concurrent=1, budget_micros=1000))
    granted = await store.reserve(reserve_request("a", scope, cost=1000, lease_s=5))
    assert isinstance(granted, Granted)
    denied = await store.reserve(reserve_request("b", scope, cost=1000))
    assert isinstance(denied, Denied)
    assert (denied.reason, denied.retry_after_s) == (DenyReason.CONCURRENCY, 1.0)
    clock.advance(4)
    assert await store.renew([granted.reservation], 5) == {"a"}
    clock.advance(4.5)
    assert (await store.usage("tenant:t", "2026-11")).concurrent == 1
    clock.advance(0.5)
    assert await store.renew([granted.reservation], 5) == set()  # expired stays expired
    assert await store.expire_leases() == 1
    assert await store.usage("tenant:t", "2026-11") == ScopeUsage(0, 0, 0, 1, 10)
    assert await store.settle(granted.reservation, 10, 400) == SettleResult(False, True)
    assert (await store.usage("tenant:t", "2026-11")).spent_micros == 400


async def test_lease_heap_stays_small_under_renewals() -> None:
    store, clock = memory_store()
    scope = Scope("tenant:t", Limits())
    granted = await store.reserve(reserve_request("a", scope, lease_s=2))
    assert isinstance(granted, Granted)
    for _ in range(1000):
        clock.advance(1)
        assert await store.renew([granted.reservation], 2) == {"a"}
    state = store._scopes["tenant:t"]
    assert len(state.lease_heap) <= 2 * len(state.leases) + 65
    assert (await store.usage("tenant:t", "2026-11")).concurrent == 1


async def test_done_markers_expire_after_their_ttl() -> None:
    clock = FakeClock()
    store = MemoryQuotaStore(clock=clock, settled_ttl_s=10)
    assert await store.charge("x", ["tenant:t"], "2026-11", 5)
    clock.advance(9)
    assert await store.charged(["x"]) == {"x"}
    clock.advance(1)
    assert await store.charged(["x"]) == set()


# ---------------------------------------------------------------------------------------
# Spend rebuilt from the ledger: the guard, rebase around a cutoff, restore.


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.integration)])
async def guarded(request: pytest.FixtureRequest) -> AsyncIterator[QuotaStore]:
    if request.param == "memory":
        yield MemoryQuotaStore(guarded=True)
        return
    client = Redis.from_url(REDIS_URL)
    prefix = f"tgtest:quota:{uuid.uuid4().hex}:"
    try:
        yield RedisQuotaStore(client, prefix=prefix, guarded=True)
    finally:
        await delete_prefix(client, prefix)
        await client.aclose()


async def test_guarded_store_admits_nothing_until_the_period_is_rebuilt(
    guarded: QuotaStore,
) -> None:
    tenant = Scope("tenant:t", Limits(budget_micros=1000))
    with pytest.raises(SpendUnknownError) as refused:
        await guarded.reserve(reserve_request("a", tenant))
    assert refused.value.period == "2026-11"
    assert refused.value.retry_after_s > 0
    assert not await guarded.is_ready("2026-11")
    assert not await guarded.finish_rebuild("2026-11", "not-a-token", 0)
    token = await guarded.begin_rebuild("2026-11")
    await guarded.rebase("2026-11", 5_000, {"tenant:t": 950})
    assert await guarded.finish_rebuild("2026-11", token, 0)
    assert await guarded.is_ready("2026-11")
    assert not await guarded.is_ready("2026-12")
    # The rebuilt spend counts: 950 spent leaves room for 50, not for 100.
    denied = await guarded.reserve(reserve_request("a", tenant))
    assert isinstance(denied, Denied)
    assert denied.reason is DenyReason.BUDGET
    assert isinstance(await guarded.reserve(reserve_request("b", tenant, cost=50)), Granted)


async def test_rebase_counts_every_ledger_row_once_around_the_cutoff(store: QuotaStore) -> None:
    scopes = ["tenant:t", "key:k"]

    async def spent() -> int:
        return (await store.usage("tenant:t", "2026-11")).spent_micros

    assert await store.charge("r100", scopes, "2026-11", 100, at_us=100)
    assert await store.charge("r300", scopes, "2026-11", 300, at_us=300)
    assert await spent() == 400
    # The ledger before 200 holds r100 and r150 (never charged): 250.
    await store.rebase("2026-11", 200, {"tenant:t": 250, "key:k": 250})
    assert await spent() == 250 + 300
    assert (await store.usage("key:k", "2026-11")).spent_micros == 550
    # A late charge of a row the base holds marks it but adds nothing; a newer row adds.
    assert await store.charge("r150", scopes, "2026-11", 150, at_us=150)
    assert not await store.charge("r150", scopes, "2026-11", 150, at_us=150)
    assert await store.charged(["r150"]) == {"r150"}
    assert await spent() == 550
    granted = await store.reserve(reserve_request("r250", Scope("tenant:t", Limits())))
    assert isinstance(granted, Granted)
    assert await store.settle(granted.reservation, 1, 250, at_us=250) == SettleResult(True, True)
    assert await spent() == 800
    # A slower rebuild with an older cutoff changes nothing; a newer one takes over.
    await store.rebase("2026-11", 100, {"tenant:t": 0})
    assert await spent() == 800
    await store.rebase("2026-11", 400, {"tenant:t": 800})
    assert await spent() == 800
    assert await store.charge("r500", scopes, "2026-11", 5, at_us=500)
    await store.rebase("2026-11", 400, {"tenant:t": 800})  # idempotent
    assert await spent() == 805


async def test_restore_gives_a_running_request_its_expired_lease_back() -> None:
    store, clock = memory_store()
    tenant = Scope("tenant:t", Limits(max_concurrent=1, budget_micros=1000))
    granted = await store.reserve(reserve_request("a", tenant, cost=600, lease_s=1.0))
    assert isinstance(granted, Granted)
    clock.advance(2)
    assert await store.usage("tenant:t", "2026-11") == ScopeUsage(0, 0, 0, 1, 10)
    assert await store.restore([granted.reservation], 30) == 1
    assert await store.restore([granted.reservation], 30) == 0  # nothing missing now
    assert await store.usage("tenant:t", "2026-11") == ScopeUsage(0, 600, 1, 1, 10)
    assert await store.settle(granted.reservation, 5, 500) == SettleResult(True, True)
    assert await store.restore([granted.reservation], 30) == 0  # settled: never again
    assert await store.usage("tenant:t", "2026-11") == ScopeUsage(500, 0, 0, 1, 5)
