"""The chart's topology on one machine, all real processes on loopback: two gateways that
find two backends through one DNS-style name (a resolver the test controls, see
resolving_tollgate.py), the Celery worker and beat, PostgreSQL and Redis. Under steady
streaming load: a rolling restart of both backends (each leaves the name, drains, comes
back), then of both gateways (each SIGTERM'd with streams open). Nothing is lost or
counted twice: every request that had not started streaming is retried and succeeds,
every started stream finishes, completed responses == completed ledger rows (any other
row belongs to a 503 the client saw and retried), reservations return to 0 and spent ==
the ledger's sum, and the Celery worker (scheduled by beat) exports every priced row to
Stripe (tests/support/fake_stripe.py) exactly once."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from tenants import db, keys
from tenants.limits import LimitSet, PlanTerms
from tenants.models import UsageEvent
from tenants.quota import RedisQuotaStore, month_period, tenant_scope
from tenants.services import ApiKeyService, PlanService, TenantService
from tests.conftest import POSTGRES_URL, REDIS_URL, eventually, migrated_postgres
from tests.e2e.processes import Process, free_port
from tests.infra.conftest import ROOT, spawn
from tests.infra.resolving_tollgate import write_hosts
from tests.support.fake_stripe import FakeStripe

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SECRET = "cluster-secret"
NAME = "tollgate-backend.cluster.test"
BACKEND_HOSTS = ("127.0.0.2", "127.0.0.3")
CLIENTS = 2  # concurrent streaming clients: steady, light load (restarts need the cores)
BIN = Path(sys.executable).parent
EXIT_TIMEOUT_S = 60


def _port_free_on_all(hosts: tuple[str, ...]) -> int:
    """One port free on every host: the pods behind a Service share their port."""
    while True:
        port = free_port()
        with contextlib.ExitStack() as stack:
            try:
                for host in hosts:
                    sock = stack.enter_context(socket.socket())
                    sock.bind((host, port))
            except OSError:
                continue
        return port


@dataclass
class Cluster:
    tmp: Path
    env: dict[str, str]
    backend_port: int
    gateway_ports: list[int]
    hosts: Path
    backends: dict[str, Process] = field(default_factory=dict)
    gateways: dict[int, Process] = field(default_factory=dict)
    celery: list[Process] = field(default_factory=list)
    model: str = ""
    stripe: FakeStripe | None = None  # where the Celery worker exports usage
    history: list[Process] = field(default_factory=list)  # every process started, for logs

    def start_backend(self, host: str) -> Process:
        process = spawn(
            [str(BIN / "tollgate"), "backend", "serve", "--host", host,
             "--port", str(self.backend_port)],
            self.env,
        )  # fmt: skip
        self.backends[host] = process
        self.history.append(process)
        return process

    def start_gateway(self, port: int) -> Process:
        argv = [sys.executable, "-m", "tests.infra.resolving_tollgate", "serve"]
        process = spawn([*argv, "--port", str(port)], self.env, cwd=self.tmp)
        self.gateways[port] = process
        self.history.append(process)
        return process

    def publish(self, *hosts: str) -> None:
        """What the backends' name resolves to from now on."""
        write_hosts(self.hosts, {NAME: list(hosts)})

    def everything(self) -> list[Process]:
        return [*self.gateways.values(), *self.backends.values(), *self.celery]


def _stop(process: Process) -> int:
    process.popen.send_signal(signal.SIGTERM)
    try:
        return process.popen.wait(timeout=EXIT_TIMEOUT_S)
    except Exception:
        raise AssertionError(f"did not exit after its drain:\n{process.text}") from None


@pytest.fixture
def stripe() -> Iterator[FakeStripe]:
    with FakeStripe().serving() as server:
        yield server


@pytest.fixture
def cluster(tmp_path: Path, stripe: FakeStripe) -> Iterator[Cluster]:
    migrated_postgres()
    env = {
        **os.environ,
        "TOLLGATE_DATABASE_URL": POSTGRES_URL,
        "TOLLGATE_REDIS_URL": REDIS_URL,
        "TOLLGATE_BACKEND_SECRET": SECRET,
        "TOLLGATE_ADMIN_KEY": keys.generate_key()[0],
        "TOLLGATE_MODEL": "",
        "TOLLGATE_DRAIN_S": "30",
        "TOLLGATE_CELERY_QUEUE": f"cluster-{uuid.uuid4().hex[:8]}",  # ours alone
        "TOLLGATE_DATA_DIR": str(tmp_path),
        "TOLLGATE_TEST_HOSTS": str(tmp_path / "hosts.json"),
        "TOLLGATE_STRIPE_API_KEY": stripe.api_key,  # the strict fake checks it
        "TOLLGATE_STRIPE_BASE_URL": stripe.url,
        "TOLLGATE_EXPORT_INTERVAL_S": "1",  # beat schedules the relay every second
        "TOLLGATE_EXPORT_RETRY_S": "1",  # a row Stripe deferred is retried a second later
        # The gateways run tests.infra.resolving_tollgate from the temporary folder.
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    cluster = Cluster(tmp_path, env, _port_free_on_all(BACKEND_HOSTS), [free_port(), free_port()],
                      tmp_path / "hosts.json")  # fmt: skip
    cluster.stripe = stripe
    env["TOLLGATE_BACKENDS"] = f"dns://{NAME}:{cluster.backend_port}"
    cluster.publish(*BACKEND_HOSTS)
    try:
        for host in BACKEND_HOSTS:
            cluster.start_backend(host)
        celery = [str(BIN / "celery"), "-A", "gateway.billing.worker"]
        queues = f"{env['TOLLGATE_CELERY_QUEUE']},{env['TOLLGATE_CELERY_QUEUE']}-batches"
        cluster.celery = [
            spawn([*celery, "worker", "-Q", queues, "--concurrency", "1", "--pool", "solo"], env),
            spawn([*celery, "beat", "--schedule", str(tmp_path / "beat-schedule")], env),
        ]
        for port in cluster.gateway_ports:  # they wait for a first backend (discovery.py)
            cluster.start_gateway(port)
        for backend in cluster.backends.values():
            backend.wait_for("ready on")
        banners = [gateway.wait_for('"model"') for gateway in cluster.gateways.values()]
        cluster.model = banners[0].split('"model": "')[1].split('"')[0]
        yield cluster
    finally:
        for process in cluster.everything():
            process.stop()


@pytest.fixture
async def sessions() -> AsyncIterator[Any]:
    engine = db.create_engine(POSTGRES_URL)
    yield db.session_factory(engine)
    await engine.dispose()


async def _tenant(sessions: Any) -> tuple[str, str]:
    """A tenant with a budget, so every request reserves and settles."""
    async with sessions.begin() as session:
        terms = PlanTerms(limits=LimitSet(monthly_budget_micros=10**9))
        await PlanService(session).create("cluster", terms)
        await TenantService(session).create("cluster")
        tenant = await TenantService(session).set_plan("cluster", "cluster")
        return tenant.id, (await ApiKeyService(session).create(tenant)).secret


@dataclass
class Load:
    """Streaming clients behind a round-robin "load balancer" (this test): a request
    refused before it streamed (connection refused, 503 draining) goes to the next
    gateway; a stream that breaks once started is lost, and counted."""

    cluster: Cluster
    key: str
    completed: list[str] = field(default_factory=list)  # request ids
    # Answered 503 by the app (no replica ready): request id (when it has one), error code.
    refused: list[tuple[str | None, str]] = field(default_factory=list)
    via: dict[str, int] = field(default_factory=dict)  # request id -> gateway port
    retried: int = 0
    broken: list[str] = field(default_factory=list)
    open_on: dict[int, int] = field(default_factory=dict)  # gateway port -> open streams
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    turn: int = 0

    def body(self, n: int) -> dict[str, Any]:
        return {
            "model": self.cluster.model,
            "messages": [{"role": "user", "content": f"Tell me about sorting, part {n}."}],
            "max_tokens": 16,
            "stream": True,
            "ignore_eos": True,
            "temperature": 0,
        }

    async def client(self, http: httpx.AsyncClient, n: int) -> None:
        while not self.stop.is_set():
            await self.one_request(http, n)
            n += CLIENTS

    async def one_request(self, http: httpx.AsyncClient, n: int) -> None:
        for _ in range(100):  # bounded: a request is retried while no gateway takes it
            self.turn += 1
            port = self.cluster.gateway_ports[self.turn % 2]
            if await self.stream(http, port, n):
                return
            self.retried += 1
            await asyncio.sleep(0.05)  # a retry back-off, not synchronisation
        raise AssertionError("no gateway took the request in 100 tries")

    async def stream(self, http: httpx.AsyncClient, port: int, n: int) -> bool:
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        headers = {"Authorization": f"Bearer {self.key}"}
        try:
            async with http.stream("POST", url, json=self.body(n), headers=headers) as response:
                if response.status_code == 503:  # nothing ran: safe to send elsewhere
                    code = json.loads(await response.aread())["error"]["code"]
                    if code != "draining":  # the app's 503, not the drain guard's
                        self.refused.append((response.headers.get("x-request-id"), code))
                    return False
                assert response.status_code == 200, await response.aread()
                request_id = response.headers["x-request-id"]
                self.via[request_id] = port
                self.open_on[port] = self.open_on.get(port, 0) + 1
                try:
                    lines = [line async for line in response.aiter_lines() if line]
                except httpx.HTTPError:
                    self.broken.append(request_id)
                    return True
                finally:
                    self.open_on[port] -= 1
        except httpx.ConnectError:
            return False  # that gateway is down or restarting
        if lines[-1] == "data: [DONE]":
            self.completed.append(request_id)
        else:
            self.broken.append(request_id)
        return True


async def _rolling_restart_of_backends(cluster: Cluster, load: Load, sessions: Any) -> None:
    for host in BACKEND_HOSTS:
        others = [h for h in BACKEND_HOSTS if h != host]
        cluster.publish(*others)  # the terminating pod leaves the Service first
        assert await asyncio.to_thread(_stop, cluster.backends[host]) == 0
        await asyncio.to_thread(cluster.start_backend(host).wait_for, "ready on")
        earlier = set(load.via)
        cluster.publish(*BACKEND_HOSTS)
        replica = f"http://{host}:{cluster.backend_port}"

        async def every_gateway_routes_to_it(
            replica: str = replica, earlier: set[str] = earlier
        ) -> bool:
            routing = await _gateways_routing_to(sessions, load, replica, earlier)
            return routing == set(cluster.gateway_ports)

        # Rediscovered by both gateways before the next one goes (a Deployment's
        # minReadySeconds does the same on Kubernetes).
        await eventually(every_gateway_routes_to_it, timeout_s=60)


async def _gateways_routing_to(
    sessions: Any, load: Load, replica: str, earlier: set[str]
) -> set[int]:
    """The gateways that sent `replica` a request since `earlier` (request ids)."""
    async with sessions() as session:
        ids = (
            await session.scalars(
                select(UsageEvent.request_id).where(UsageEvent.replica == replica)
            )
        ).all()
    return {load.via[i] for i in ids if i in load.via and i not in earlier}


def _log_lines(cluster: Cluster, request_ids: list[str]) -> list[str]:
    """What the processes logged about these requests (for a failure's message)."""
    lines = []
    for process in cluster.history:
        with contextlib.suppress(Exception):
            while True:
                process.output.append(process.lines.get_nowait())
        lines += [line[:600] for line in process.output if any(i in line for i in request_ids)]
    return lines


async def _rolling_restart_of_gateways(cluster: Cluster, load: Load) -> None:
    for port in cluster.gateway_ports:

        def streaming(port: int = port) -> bool:
            return load.open_on.get(port, 0) > 0

        await eventually(streaming, timeout_s=30)
        broken = len(load.broken)
        assert await asyncio.to_thread(_stop, cluster.gateways[port]) == 0
        assert len(load.broken) == broken  # its open streams all finished
        await asyncio.to_thread(cluster.start_gateway(port).wait_for, '"model"')


async def test_rolling_restarts_lose_nothing(cluster: Cluster, sessions: Any) -> None:
    tenant_id, key = await _tenant(sessions)
    load = Load(cluster, key)
    limits = httpx.Limits(max_connections=CLIENTS + 4)
    async with httpx.AsyncClient(timeout=60, limits=limits) as http:
        clients = [asyncio.create_task(load.client(http, n)) for n in range(CLIENTS)]
        try:
            await eventually(lambda: len(load.completed) >= CLIENTS, timeout_s=60)
            await _rolling_restart_of_backends(cluster, load, sessions)
            await _rolling_restart_of_gateways(cluster, load)
            done = len(load.completed)
            await eventually(lambda: len(load.completed) > done + CLIENTS, timeout_s=60)
        finally:
            load.stop.set()
            await asyncio.gather(*clients)
    assert not load.broken
    assert all(process.popen.poll() is None for process in cluster.celery)
    for gateway in cluster.gateways.values():  # their shutdown settles what is left
        assert await asyncio.to_thread(_stop, gateway) == 0

    async with sessions() as session:
        rows = (
            await session.execute(
                select(
                    UsageEvent.request_id,
                    UsageEvent.status,
                    UsageEvent.replica,
                    UsageEvent.error,
                    UsageEvent.cost_micros,
                ).where(UsageEvent.tenant_id == tenant_id)
            )
        ).all()
        spent_in_ledger = (
            await session.scalar(
                select(func.coalesce(func.sum(UsageEvent.cost_micros), 0)).where(
                    UsageEvent.tenant_id == tenant_id
                )
            )
        ) or 0
    status = {r.request_id: r.status for r in rows}
    completed = set(load.completed)
    missing = completed - status.keys()
    assert not missing, (missing, _log_lines(cluster, sorted(missing)))
    # One row per completed response, and no completed row the client did not get.
    assert {i for i, s in status.items() if s == "completed"} == completed
    # Any other row is a 503 the client saw (no replica answered the gateway in time,
    # e.g. a health poll timing out on a starved machine) and sent elsewhere.
    others = [(r.request_id, r.status, r.error) for r in rows if r.request_id not in completed]
    refused_ids = {request_id for request_id, _ in load.refused}
    unseen = [row for row in others if row[0] not in refused_ids]
    anonymous = sum(1 for request_id, _ in load.refused if request_id is None)
    logged = _log_lines(cluster, [row[0] for row in unseen])
    assert len(unseen) <= anonymous, (unseen, load.refused, logged)
    assert len(completed) == len(load.completed)  # no response counted twice
    replicas = {r.replica for r in rows if r.status == "completed"}
    assert replicas == {f"http://{h}:{cluster.backend_port}" for h in BACKEND_HOSTS}
    store = RedisQuotaStore.from_url(REDIS_URL)
    try:
        usage = await store.usage(tenant_scope(tenant_id), month_period())
    finally:
        await store.aclose()
    assert usage.reserved_micros == 0 and usage.concurrent == 0
    assert usage.spent_micros == spent_in_ledger > 0
    # Worker and beat exported the ledger to Stripe (the fake), every row once.
    stripe = cluster.stripe
    assert stripe is not None
    priced = sum(1 for r in rows if r.cost_micros > 0)
    await eventually(lambda: stripe.accepted() == priced, timeout_s=60)
    assert sum(stripe.customer_totals().values()) == spent_in_ledger
    print(
        f"cluster: {len(load.completed)} streams completed, {len(load.refused)} answered 503 "
        f"by a gateway, {load.retried} sent again"
    )
