"""Two gateway processes sharing PostgreSQL and Redis: quotas and idempotency hold
across replicas, under concurrency, and through a SIGKILL."""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from gateway.metering.recorder import ORPHAN_SWEEP_S, STALE_AFTER_S
from tenants import db, keys
from tenants.limits import LimitSet, PlanTerms
from tenants.models import UsageEvent
from tenants.pricing import DEFAULT_PRICE
from tenants.quota import RedisQuotaStore, ScopeUsage, month_period, tenant_scope
from tenants.services import ApiKeyService, PlanService, TenantService
from tests.conftest import POSTGRES_URL, REDIS_URL, migrated_postgres
from tests.e2e.processes import Process, free_port, running, start

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPT = "Return the"
LEASE_S = 6  # short, so the SIGKILL test is quick; long enough that a busy CI keeps leases


@dataclass
class Cluster:
    urls: list[str]
    gateways: list[Process]
    model: str
    prompt_tokens: int


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    migrated_postgres()
    admin_key, _ = keys.generate_key()
    env = {
        "TOLLGATE_DATABASE_URL": POSTGRES_URL,
        "TOLLGATE_REDIS_URL": REDIS_URL,
        "TOLLGATE_MODEL": os.environ.get("TOLLGATE_TEST_MODEL", ""),
        "TOLLGATE_ADMIN_KEY": admin_key,
        "TOLLGATE_LEASE_S": str(LEASE_S),
        "TOLLGATE_MAX_NUM_SEQS": "64",
    }
    ports = [free_port(), free_port()]
    gateways = [start(["serve", "--port", str(port)], env) for port in ports]
    with running(*gateways):
        banners = [gateway.wait_for('"model"') for gateway in gateways]
        model = banners[0].split('"model": "')[1].split('"')[0]
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        tokens = httpx.post(
            f"{urls[0]}/v1/completions",
            json={"model": model, "prompt": PROMPT, "max_tokens": 1},
            headers={"Authorization": f"Bearer {admin_key}"},
        ).json()["usage"]["prompt_tokens"]
        yield Cluster(urls, gateways, model, tokens)


@pytest.fixture
async def sessions() -> AsyncIterator[Any]:
    engine = db.create_engine(POSTGRES_URL)
    yield db.session_factory(engine)
    await engine.dispose()


async def _tenant(sessions: Any, limits: LimitSet) -> tuple[str, str]:
    name = f"t{uuid.uuid4().hex[:12]}"
    async with sessions.begin() as session:
        await PlanService(session).create(name, PlanTerms(limits=limits))
        await TenantService(session).create(name)
        tenant = await TenantService(session).set_plan(name, name)
        return tenant.id, (await ApiKeyService(session).create(tenant)).secret


async def _usage(tenant_id: str) -> ScopeUsage:
    store = RedisQuotaStore.from_url(REDIS_URL)
    try:
        return await store.usage(tenant_scope(tenant_id), month_period())
    finally:
        await store.aclose()


async def _ledger(sessions: Any, tenant_id: str) -> tuple[int, int]:
    async with sessions() as session:
        query = select(func.count(), func.coalesce(func.sum(UsageEvent.cost_micros), 0)).where(
            UsageEvent.tenant_id == tenant_id
        )
        count, cost = (await session.execute(query)).one()
        return int(count), int(cost)


async def _burst(
    cluster: Cluster,
    key: str,
    count: int,
    body: dict[str, Any],
    extra: dict[str, str] | None = None,
) -> list[httpx.Response]:
    headers = {"Authorization": f"Bearer {key}", **(extra or {})}
    limits = httpx.Limits(max_connections=count)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        return await asyncio.gather(
            *(
                http.post(f"{cluster.urls[i % 2]}/v1/completions", json=body, headers=headers)
                for i in range(count)
            )
        )


def _body(cluster: Cluster, max_tokens: int) -> dict[str, Any]:
    return {"model": cluster.model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}


async def test_budget_holds_across_replicas(cluster: Cluster, sessions: Any) -> None:
    worst = DEFAULT_PRICE.cost_micros(cluster.prompt_tokens, 0, 2)
    budget = 10 * worst
    tenant_id, key = await _tenant(sessions, LimitSet(monthly_budget_micros=budget))
    samples: list[ScopeUsage] = []

    async def watch(done: asyncio.Event) -> None:
        while not done.is_set():
            samples.append(await _usage(tenant_id))
            await asyncio.sleep(0.005)  # sampling period of the observer, not synchronisation

    done = asyncio.Event()
    watcher = asyncio.create_task(watch(done))
    responses = await _burst(cluster, key, 200, _body(cluster, 2))
    done.set()
    await watcher
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429}, codes
    assert codes.count(200) >= 10
    assert all(
        r.json()["error"]["code"] == "insufficient_quota" for r in responses if r.status_code == 429
    )
    over = [s for s in samples if s.spent_micros + s.reserved_micros > budget]
    assert samples and not over, (budget, over[:3])

    final = await _usage(tenant_id)
    rows, charged = await _ledger(sessions, tenant_id)
    assert final.reserved_micros == 0 and final.concurrent == 0
    assert final.spent_micros == charged <= budget
    assert rows == codes.count(200)


async def test_tokens_per_minute_hold_across_replicas(cluster: Cluster, sessions: Any) -> None:
    per_request = cluster.prompt_tokens + 2
    tpm = 20 * per_request
    _, key = await _tenant(sessions, LimitSet(tpm=tpm))
    responses = await _burst(cluster, key, 100, _body(cluster, 2))
    admitted = [r for r in responses if r.status_code == 200]
    assert len(admitted) * per_request <= tpm
    assert len(admitted) == 20  # the limit is used, not just respected
    assert all(
        r.status_code == 429 and r.headers["retry-after"] for r in responses if r not in admitted
    )


async def test_idempotency_across_replicas(cluster: Cluster, sessions: Any) -> None:
    tenant_id, key = await _tenant(sessions, LimitSet())
    body = _body(cluster, 8)
    responses = await _burst(cluster, key, 50, body, {"Idempotency-Key": "pay-42"})
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 409}, codes
    originals = [
        r for r in responses if r.status_code == 200 and "idempotent-replayed" not in r.headers
    ]
    assert len(originals) == 1
    assert all(r.content == originals[0].content for r in responses if r.status_code == 200)
    assert (await _ledger(sessions, tenant_id))[0] == 1
    other = await _burst(cluster, key, 1, _body(cluster, 3), {"Idempotency-Key": "pay-42"})
    assert other[0].status_code == 422


CHECKPOINT_S = 0.2  # the victim's checkpoint interval in the SIGKILL billing test
WRITE_SLACK_S = 0.2  # what the last checkpoint write may take on this busy 2-core VM

# Streams that outlast the test's polling even on a fast machine: none may finish (and
# settle) before the gateway is killed.
BUSY = 1000


async def test_killed_gateway_strands_no_budget(cluster: Cluster, sessions: Any) -> None:
    worst = DEFAULT_PRICE.cost_micros(cluster.prompt_tokens, 0, BUSY)
    tenant_id, key = await _tenant(sessions, LimitSet(monthly_budget_micros=4 * worst))
    port = free_port()
    victim = start(["serve", "--port", str(port)], _env_of(cluster))
    with running(victim):
        victim.wait_for('"model"')
        streams = [_open_stream(f"http://127.0.0.1:{port}", key, cluster) for _ in range(4)]
        tasks = [asyncio.create_task(stream) for stream in streams]
        await _eventually(lambda: _usage(tenant_id), lambda u: u.reserved_micros == 4 * worst)
        victim.kill()
        await asyncio.gather(*tasks, return_exceptions=True)
    # The dead process's reservations are released when their leases run out.
    await _eventually(
        lambda: _usage(tenant_id), lambda u: u.reserved_micros == 0, timeout_s=4 * LEASE_S + 5
    )
    # The whole budget is available again: four worst cases are admitted on a live replica.
    responses = await _burst(cluster, key, 4, _body(cluster, BUSY))
    assert [r.status_code for r in responses] == [200] * 4


def _env_of(cluster: Cluster) -> dict[str, str]:
    return {
        "TOLLGATE_DATABASE_URL": POSTGRES_URL,
        "TOLLGATE_REDIS_URL": REDIS_URL,
        "TOLLGATE_MODEL": os.environ.get("TOLLGATE_TEST_MODEL", ""),
        "TOLLGATE_LEASE_S": str(LEASE_S),
    }


async def _open_stream(base: str, key: str, cluster: Cluster) -> None:
    body = _body(cluster, BUSY) | {"stream": True, "ignore_eos": True}
    async with (
        httpx.AsyncClient(timeout=120) as http,
        http.stream(
            "POST", f"{base}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        ) as response,
    ):
        async for _ in response.aiter_lines():
            pass


async def _eventually(read: Any, check: Any, timeout_s: float = 30) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check(await read()):
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not reached within {timeout_s} s: {await read()}")
        await asyncio.sleep(0.05)


@dataclass
class Followed:
    """What a client saw of one stream: its request id and when each text chunk came."""

    request_id: str = ""
    chunks_at: list[float] = field(default_factory=list)


async def _follow(base: str, key: str, cluster: Cluster, seen: Followed) -> None:
    body = _body(cluster, BUSY) | {"stream": True, "ignore_eos": True}
    async with (
        httpx.AsyncClient(timeout=120) as http,
        http.stream(
            "POST", f"{base}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        ) as response,
    ):
        seen.request_id = response.headers["x-request-id"]
        async for line in response.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                seen.chunks_at.append(time.monotonic())


async def test_killed_gateway_bills_what_its_streams_delivered(
    cluster: Cluster, sessions: Any
) -> None:
    tenant_id, key = await _tenant(sessions, LimitSet())
    port = free_port()
    # Short checkpoints: the tiny model streams a whole answer in about a second.
    env = _env_of(cluster) | {"TOLLGATE_CHECKPOINT_MS": str(int(CHECKPOINT_S * 1000))}
    victim = start(["serve", "--port", str(port)], env)
    followed = [Followed(), Followed()]
    with running(victim):
        victim.wait_for('"model"')
        base = f"http://127.0.0.1:{port}"
        tasks = [asyncio.create_task(_follow(base, key, cluster, seen)) for seen in followed]

        async def progress() -> list[float]:  # seconds each stream has been delivering
            return [s.chunks_at[-1] - s.chunks_at[0] if s.chunks_at else 0.0 for s in followed]

        # Long enough that checkpoints were written while tokens flowed.
        await _eventually(progress, lambda spans: min(spans) > 3 * CHECKPOINT_S, 60)
        victim.kill()
        killed_at = time.monotonic()
        await asyncio.gather(*tasks, return_exceptions=True)
    # Another gateway finds the stale checkpoints and bills them.
    bound_s = STALE_AFTER_S + ORPHAN_SWEEP_S + CHECKPOINT_S + 10

    async def rows() -> dict[str, UsageEvent]:
        async with sessions() as session:
            query = select(UsageEvent).where(UsageEvent.tenant_id == tenant_id)
            return {row.request_id: row for row in (await session.scalars(query)).all()}

    await _eventually(rows, lambda found: len(found) == 2, timeout_s=bound_s)
    billed = await rows()
    for seen in followed:
        row = billed[seen.request_id]
        received = len(seen.chunks_at)
        bound = killed_at - CHECKPOINT_S - WRITE_SLACK_S
        checkpointed = sum(t <= bound for t in seen.chunks_at)
        print(
            f"\nstream {seen.request_id}: {received} chunks received, "
            f"{row.completion_tokens} tokens billed, {checkpointed} chunks "
            f"{CHECKPOINT_S + WRITE_SLACK_S:g} s before the kill"
        )
        assert (row.status, row.error) == ("failed", "gateway_lost")
        # Everything delivered up to one checkpoint interval (and write) before the kill.
        assert checkpointed <= row.completion_tokens < BUSY
        assert row.cost_micros == DEFAULT_PRICE.cost_micros(
            cluster.prompt_tokens, 0, row.completion_tokens
        )
