"""RedisQuotaStore on a real Redis (127.0.0.1:6379): atomicity under 200 concurrent
callers on several connections, real lease expiry, the window ageing out, the sweep,
key hygiene, and one round trip per operation.

Each test gets its own key prefix and deletes its keys afterwards. Waits for real time
(a 0.3 s lease, a 0.5 s window) poll the store with a deadline; nothing sleeps to
synchronise.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Redis

from tenants.quota import (
    Denied,
    DenyReason,
    Granted,
    Limits,
    RedisQuotaStore,
    Reservation,
    ReserveRequest,
    Scope,
    ScopeUsage,
    SettleResult,
    SpendUnknownError,
    StoreUnavailableError,
    wall_us,
)
from tenants.quota import redis as quota_redis
from tenants.quota.redis import WaitingConnectionPool
from tests.conftest import REDIS_URL, eventually

pytestmark = pytest.mark.integration

PERIOD = "2026-11"


class Replicas:
    """Stores that share one key prefix, each on its own small connection pool (the
    gateway's kind: its callers wait for a connection), like gateway replicas sharing
    one Redis."""

    def __init__(self) -> None:
        self.prefix = f"tgtest:quota:{uuid.uuid4().hex}:"
        self.clients: list[Redis] = []

    def client(self, **kwargs: Any) -> Redis:
        pool = WaitingConnectionPool.from_url(REDIS_URL, max_connections=4, **kwargs)
        client = Redis(connection_pool=pool)
        self.clients.append(client)
        return client

    def store(self, **kwargs: Any) -> RedisQuotaStore:
        return RedisQuotaStore(self.client(), prefix=self.prefix, **kwargs)

    async def keys(self) -> set[str]:
        client = self.clients[0] if self.clients else self.client()
        return {
            key.decode().removeprefix(self.prefix)
            async for key in client.scan_iter(match=f"{self.prefix}*", count=500)
        }

    async def close(self) -> None:
        client = self.clients[0] if self.clients else self.client()
        keys = [key async for key in client.scan_iter(match=f"{self.prefix}*", count=500)]
        if keys:
            await client.delete(*keys)
        for each in self.clients:
            await each.aclose()
            await each.connection_pool.disconnect()


@pytest.fixture
async def replicas() -> AsyncIterator[Replicas]:
    replicas = Replicas()
    try:
        yield replicas
    finally:
        await replicas.close()


def request(
    rid: str, *scopes: Scope, tokens: int = 10, cost: int = 1000, lease_s: float = 60.0
) -> ReserveRequest:
    return ReserveRequest(rid, scopes, tokens, cost, PERIOD, lease_s)


async def usage_of(store: RedisQuotaStore, scope: str) -> ScopeUsage:
    return await store.usage(scope, PERIOD)


async def server_time(client: Redis) -> float:
    seconds, micros = await client.time()
    return seconds + micros / 1e6


async def until_server_time(client: Redis, moment: float) -> None:
    """Poll the Redis clock (the one the scripts use) until it has passed `moment`."""

    async def passed() -> bool:
        return await server_time(client) > moment

    await eventually(passed, timeout_s=5)


async def test_budget_that_fits_n_admits_exactly_n_of_200_concurrent(replicas: Replicas) -> None:
    stores = [replicas.store() for _ in range(4)]
    fits, cost = 37, 1000
    budget = fits * cost + cost - 1
    tenant = Scope("tenant:t", Limits(budget_micros=budget))
    highest_reserved = 0
    done = asyncio.Event()

    async def watch() -> None:
        nonlocal highest_reserved
        while not done.is_set():
            seen = await usage_of(stores[0], "tenant:t")
            assert seen.spent_micros + seen.reserved_micros <= budget
            highest_reserved = max(highest_reserved, seen.reserved_micros)
            await asyncio.sleep(0)

    watcher = asyncio.create_task(watch())
    outcomes = await asyncio.gather(
        *(stores[i % 4].reserve(request(f"r{i}", tenant, cost=cost)) for i in range(200))
    )
    done.set()
    await watcher
    granted = [o for o in outcomes if isinstance(o, Granted)]
    denied = [o for o in outcomes if isinstance(o, Denied)]
    assert len(granted) == fits
    assert {(d.reason, d.scope_key, d.retry_after_s) for d in denied} == {
        (DenyReason.BUDGET, "tenant:t", None)
    }
    assert highest_reserved <= fits * cost
    assert await usage_of(stores[1], "tenant:t") == ScopeUsage(
        0, fits * cost, fits, fits, 10 * fits
    )

    actual = {g.reservation.reservation_id: 400 + 13 * i for i, g in enumerate(granted)}
    results = await asyncio.gather(
        *(
            stores[i % 4].settle(g.reservation, 7, actual[g.reservation.reservation_id])
            for i, g in enumerate(granted)
        )
    )
    assert set(results) == {SettleResult(True, True)}
    spent = sum(actual.values())
    assert await usage_of(stores[2], "tenant:t") == ScopeUsage(spent, 0, 0, fits, 7 * fits)

    # What is left of the budget admits exactly as many more.
    second = await asyncio.gather(
        *(stores[i % 4].reserve(request(f"s{i}", tenant, cost=cost)) for i in range(200))
    )
    assert sum(isinstance(o, Granted) for o in second) == (budget - spent) // cost


async def test_tpm_across_scopes_never_admits_more_than_the_window_allows(
    replicas: Replicas,
) -> None:
    stores = [replicas.store() for _ in range(4)]
    tenant = Scope("tenant:t", Limits(tpm=1000))
    keys = [Scope("key:a", Limits(tpm=300)), Scope("key:b", Limits())]
    outcomes = await asyncio.gather(
        *(
            stores[i % 4].reserve(request(f"r{i}", keys[i % 2], tenant, tokens=30))
            for i in range(200)
        )
    )
    granted_a = sum(isinstance(o, Granted) for o in outcomes[0::2])
    granted_b = sum(isinstance(o, Granted) for o in outcomes[1::2])
    assert granted_a <= 10
    assert granted_a + granted_b == 1000 // 30
    tenant_usage = await usage_of(stores[0], "tenant:t")
    assert tenant_usage.tokens_in_window == 30 * (granted_a + granted_b) <= 1000
    assert (await usage_of(stores[0], "key:a")).tokens_in_window == 30 * granted_a
    for outcome in outcomes:
        if isinstance(outcome, Denied):
            assert outcome.reason is DenyReason.TPM
            assert outcome.retry_after_s is not None
            assert 0 < outcome.retry_after_s <= 60


async def test_concurrency_slots_under_200_concurrent(replicas: Replicas) -> None:
    stores = [replicas.store() for _ in range(4)]
    tenant = Scope("tenant:t", Limits(max_concurrent=7))
    outcomes = await asyncio.gather(
        *(stores[i % 4].reserve(request(f"r{i}", tenant)) for i in range(200))
    )
    granted = [o for o in outcomes if isinstance(o, Granted)]
    assert len(granted) == 7
    assert all(
        isinstance(o, Denied) and o.reason is DenyReason.CONCURRENCY and o.retry_after_s == 1.0
        for o in outcomes
        if not isinstance(o, Granted)
    )
    for g in granted[:3]:
        await stores[0].settle(g.reservation, 1, 1)
    again = await asyncio.gather(
        *(stores[i % 4].reserve(request(f"s{i}", tenant)) for i in range(50))
    )
    assert sum(isinstance(o, Granted) for o in again) == 3
    assert (await usage_of(stores[0], "tenant:t")).concurrent == 7


async def test_expired_lease_returns_the_budget_and_a_late_settle_still_charges(
    replicas: Replicas,
) -> None:
    store = replicas.store()
    tenant = Scope("tenant:t", Limits(max_concurrent=1, budget_micros=1000))
    started = await server_time(replicas.clients[0])
    crashed = await store.reserve(request("crashed", tenant, cost=1000, lease_s=0.3))
    assert isinstance(crashed, Granted)
    blocked = await store.reserve(request("blocked", tenant, cost=1000))
    assert isinstance(blocked, Denied)
    assert blocked.reason is DenyReason.CONCURRENCY
    # Expired but not yet released (nothing touched the scope): renew cannot revive it.
    await until_server_time(replicas.clients[0], started + 0.35)
    assert await store.renew([crashed.reservation], 30) == set()

    async def released() -> bool:
        seen = await usage_of(store, "tenant:t")
        return (seen.reserved_micros, seen.concurrent) == (0, 0)

    await eventually(released, timeout_s=5)
    assert isinstance(await store.reserve(request("next", tenant, cost=600)), Granted)
    # The crashed request's work did happen: its settle (or the reconciler) charges it.
    assert await store.settle(crashed.reservation, 10, 300) == SettleResult(False, True)
    assert await usage_of(store, "tenant:t") == ScopeUsage(300, 600, 1, 2, 20)


async def test_sweep_releases_expired_leases_in_every_scope(replicas: Replicas) -> None:
    store = replicas.store()
    scopes = (Scope("key:k", Limits()), Scope("tenant:t", Limits(budget_micros=5000)))
    granted = await store.reserve(request("a", *scopes, cost=5000, lease_s=0.3))
    assert isinstance(granted, Granted)
    released = 0

    async def swept() -> bool:
        nonlocal released
        released += await store.expire_leases()
        return released >= 2

    await eventually(swept, timeout_s=5)
    assert released == 2
    keys = await replicas.keys()
    assert not {k for k in keys if k.endswith((":lease", ":held"))}
    assert "active" not in keys
    assert (await usage_of(store, "tenant:t")).reserved_micros == 0

    # A renew that shortens a lease brings the sweep forward too.
    long = await store.reserve(request("b", *scopes, cost=5000, lease_s=30))
    assert isinstance(long, Granted)
    assert await store.renew([long.reservation], 0.3) == {"b"}
    released = 0
    await eventually(swept, timeout_s=5)
    assert released == 2


async def test_renewed_lease_outlives_its_first_expiry(replicas: Replicas) -> None:
    store = replicas.store()
    tenant = Scope("tenant:t", Limits())
    kept = await store.reserve(request("kept", tenant, lease_s=0.3))
    dropped = await store.reserve(request("dropped", tenant, lease_s=0.3))
    assert isinstance(kept, Granted)
    assert isinstance(dropped, Granted)
    assert await store.renew([kept.reservation], 30) == {"kept"}

    async def one_left() -> bool:
        return (await usage_of(store, "tenant:t")).concurrent == 1

    await eventually(one_left, timeout_s=5)
    assert await store.renew([kept.reservation, dropped.reservation], 30) == {"kept"}


async def test_window_ages_out_with_the_actual_tokens(replicas: Replicas) -> None:
    store = replicas.store(window_s=0.5)
    tenant = Scope("tenant:t", Limits(rpm=2, tpm=100))
    first = await store.reserve(request("a", tenant, tokens=90))
    assert isinstance(first, Granted)
    assert first.requests.reset_s == 0.5
    denied = await store.reserve(request("b", tenant, tokens=50))
    assert isinstance(denied, Denied)
    assert denied.reason is DenyReason.TPM
    assert denied.retry_after_s is not None
    assert 0 < denied.retry_after_s <= 0.5
    await store.settle(first.reservation, 10, 5)
    second = await store.reserve(request("b", tenant, tokens=50))
    assert isinstance(second, Granted)
    await store.settle(second.reservation, 50, 5)
    third = await store.reserve(request("c", tenant, tokens=1))
    assert isinstance(third, Denied)
    assert third.reason is DenyReason.RPM

    async def window_empty() -> bool:
        seen = await usage_of(store, "tenant:t")
        return (seen.requests_in_window, seen.tokens_in_window) == (0, 0)

    await eventually(window_empty, timeout_s=5)
    # The running total left with exactly what entered: no drift, nothing left behind
    # (recent: the charges since the last rebase, which the next rebase folds in).
    assert await replicas.clients[0].hgetall(f"{replicas.prefix}s:tenant:t:st") == {
        b"spent:2026-11": b"10",
        b"recent:2026-11": b"10",
    }
    assert isinstance(await store.reserve(request("c", tenant, tokens=100)), Granted)


async def test_nothing_is_left_behind_but_spent_and_done_markers(replicas: Replicas) -> None:
    store = replicas.store(window_s=0.5, settled_ttl_s=600)
    scopes = (Scope("key:k", Limits(rpm=5)), Scope("tenant:t", Limits(budget_micros=10**6)))
    granted = await store.reserve(request("a", *scopes))
    assert isinstance(granted, Granted)
    layout = {
        f"s:{s}:{part}"
        for s in ("key:k", "tenant:t")
        for part in ("st", "lease", "held", "win", "wtok")
    }
    assert await replicas.keys() == layout | {"active"}
    assert await store.settle(granted.reservation, 5, 700) == SettleResult(True, True)

    # What is left: spent, the done marker, and the charge until a rebase folds it in.
    charges = {f"s:{s}:{part}:{PERIOD}" for s in ("key:k", "tenant:t") for part in ("chg", "chgc")}

    async def only_ledger_left() -> bool:
        await usage_of(store, "key:k")
        await usage_of(store, "tenant:t")
        return await replicas.keys() == {"s:key:k:st", "s:tenant:t:st", "done:a"} | charges

    await eventually(only_ledger_left, timeout_s=5)
    ttl = await replicas.clients[0].ttl(f"{replicas.prefix}done:a")
    assert 590 <= ttl <= 600


async def test_each_operation_is_one_round_trip(replicas: Replicas) -> None:
    """Counted by the server (MONITOR): the clients' commands that name this test's keys."""
    client = replicas.client()
    store = RedisQuotaStore(client, prefix=replicas.prefix)
    scopes = (Scope("key:k", Limits(rpm=100)), Scope("tenant:t", Limits(tpm=10**6)))

    async def every_operation(rid: str) -> None:
        granted = await store.reserve(request(rid, *scopes))
        assert isinstance(granted, Granted)
        await store.renew([granted.reservation], 30)
        await store.settle(granted.reservation, 1, 1)
        await store.charge(f"c-{rid}", ["tenant:t"], PERIOD, 1)
        await store.charged([rid, f"c-{rid}"])
        await store.usage("tenant:t", PERIOD)

    await every_operation("warm")  # loads the scripts (EVALSHA, then SCRIPT LOAD once)
    end = f"{replicas.prefix}end"
    calls: list[str] = []
    async with replicas.client().monitor() as monitor:
        await every_operation("measured")
        await client.echo(end)
        while end not in (sent := await monitor.next_command())["command"]:
            if replicas.prefix in sent["command"] and sent["client_type"] != "lua":
                calls.append(sent["command"].split()[0])  # not those the scripts make
    assert calls == ["EVALSHA"] * 4 + ["MGET", "EVALSHA"]


async def test_a_script_the_server_lost_is_loaded_again(replicas: Replicas) -> None:
    """After SCRIPT FLUSH (as after a restart) the next call loads its script and runs."""
    store = replicas.store()
    tenant = Scope("tenant:t", Limits(rpm=3))
    assert isinstance(await store.reserve(request("a", tenant)), Granted)
    await replicas.clients[0].script_flush()
    granted = await store.reserve(request("b", tenant))
    assert isinstance(granted, Granted)
    assert await store.settle(granted.reservation, 1, 2) == SettleResult(True, True)


async def test_store_works_with_decoded_responses(replicas: Replicas) -> None:
    store = RedisQuotaStore(replicas.client(decode_responses=True), prefix=replicas.prefix)
    tenant = Scope("tenant:t", Limits(rpm=3))
    granted = await store.reserve(request("a", tenant))
    assert isinstance(granted, Granted)
    assert await store.renew(
        [granted.reservation, Reservation("zz", ("tenant:t",), PERIOD)], 5
    ) == {"a"}
    assert await store.settle(granted.reservation, 1, 2) == SettleResult(True, True)
    assert await store.charged(["a", "zz"]) == {"a"}
    assert (await store.expire_leases()) == 0


async def test_a_wiped_store_refuses_until_rebuilt_and_running_leases_are_restored(
    replicas: Replicas,
) -> None:
    store = replicas.store(guarded=True)
    tenant = Scope("tenant:t", Limits(budget_micros=1000))
    assert await store.finish_rebuild(PERIOD, await store.begin_rebuild(PERIOD), 0)
    running = await store.reserve(request("running", tenant, cost=600))
    assert isinstance(running, Granted)

    async def wipe() -> None:  # what a restart of a Redis that keeps nothing on disk does
        keys = [k async for k in replicas.clients[0].scan_iter(match=f"{replicas.prefix}*")]
        await replicas.clients[0].delete(*keys)

    await wipe()
    with pytest.raises(SpendUnknownError):
        await store.reserve(request("blind", tenant, cost=100))
    # A rebuild that the store loses half-way (another restart) does not count.
    lost = await store.begin_rebuild(PERIOD)
    await wipe()
    assert not await store.finish_rebuild(PERIOD, lost, 0)
    # The gateway still running `running` gives it its lease back; the ledger's 300 too.
    assert await store.restore([running.reservation], 30) == 1
    token = await store.begin_rebuild(PERIOD)
    await store.rebase(PERIOD, wall_us(), {"tenant:t": 300})
    assert await store.finish_rebuild(PERIOD, token, hold_s=0.3)
    with pytest.raises(SpendUnknownError) as held:
        await store.reserve(request("early", tenant, cost=100))
    assert 0 < held.value.retry_after_s <= 0.3

    async def admitted() -> bool:
        try:
            return isinstance(await store.reserve(request("after", tenant, cost=100)), Granted)
        except SpendUnknownError:
            return False

    await eventually(admitted, timeout_s=5)
    assert await usage_of(store, "tenant:t") == ScopeUsage(300, 700, 2, 1, 10)
    over = await store.reserve(request("over", tenant, cost=1))
    assert isinstance(over, Denied)
    assert over.reason is DenyReason.BUDGET


async def test_store_outage_is_a_typed_error(replicas: Replicas) -> None:
    from tests.e2e.processes import free_port

    store = RedisQuotaStore.from_url(f"redis://127.0.0.1:{free_port()}/0", prefix=replicas.prefix)
    try:
        with pytest.raises(StoreUnavailableError):
            await store.usage("tenant:t", PERIOD)
    finally:
        await store.aclose()


async def test_callers_past_the_pools_connections_wait_for_one(replicas: Replicas) -> None:
    """The gateway's store (RedisQuotaStore.from_url) on a pool of two connections: 50
    reservations at once all get an answer, none an outage, on two connections."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(quota_redis, "MAX_CONNECTIONS", 2)
        store = RedisQuotaStore.from_url(REDIS_URL, prefix=replicas.prefix)
    try:
        tenant = Scope("tenant:t", Limits())
        outcomes = await asyncio.gather(
            *(store.reserve(request(f"r{i}", tenant)) for i in range(50))
        )
        assert all(isinstance(outcome, Granted) for outcome in outcomes)
        pool = store._client.connection_pool
        assert isinstance(pool, WaitingConnectionPool)
        assert len(pool._available_connections) + len(pool._in_use_connections) == 2
    finally:
        await store.aclose()


async def test_a_caller_that_gets_no_connection_in_time_hears_of_an_outage(
    replicas: Replicas,
) -> None:
    client = replicas.client()
    store = RedisQuotaStore(client, prefix=replicas.prefix)
    pool = client.connection_pool
    assert isinstance(pool, WaitingConnectionPool)
    taken = [await pool.get_connection() for _ in range(pool.max_connections)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(quota_redis, "POOL_WAIT_S", 0.05)
        with pytest.raises(StoreUnavailableError):
            await usage_of(store, "tenant:t")
    for connection in taken:
        await pool.release(connection)
    assert await usage_of(store, "tenant:t") == ScopeUsage(0, 0, 0, 0, 0)


async def test_a_woken_caller_that_is_cancelled_passes_the_connection_on() -> None:
    pool = WaitingConnectionPool.from_url(REDIS_URL, max_connections=1)
    try:
        held = await pool.get_connection()
        first = asyncio.ensure_future(pool.get_connection())
        second = asyncio.ensure_future(pool.get_connection())
        await eventually(lambda: len(pool._waiters) == 2)
        await pool.release(held)  # wakes the first...
        first.cancel()  # ...which is cancelled before it takes the connection
        connection = await asyncio.wait_for(second, 2)  # far below POOL_WAIT_S
        assert first.cancelled()
        await pool.release(connection)
    finally:
        await pool.disconnect()
