"""Faults under load (issue 13): the stack with everything real on loopback — its own
PostgreSQL and redis-server, two backend replicas, two gateways, a Celery worker exporting
to the fake Stripe — under a steady open-loop load of streamed and whole requests from
three tenants on budgets and TPM limits. Faults come one after another: Redis restarted,
PostgreSQL restarted, a backend SIGKILLed mid-stream, a gateway SIGKILLed with streams
in flight, the Celery worker SIGKILLed mid-export. A supervisor (the test) restarts what
was killed, as systemd or Kubernetes would; the client side fails over from a gateway that
refuses connections, as a load balancer would.

After each fault the service recovers within RECOVERY_BOUND_S (15 s): from the fault
until a probe is answered and no later request of that phase fails (for the worker: until
Stripe gets events again). No request hangs: each ends with an answer or a clean error
within its timeout. At the end: nothing is reserved, spent equals the ledger and no tenant
spent past its budget, each response a client received (whole or partial) has its one
ledger row and nothing else is billed (but a whole answer whose row had committed when
the gateway's kill cut it from its client: metering writes the row first), and per
customer the fake Stripe's total equals the ledger's, each billed row sent once.
`pytest -s` prints a table: per fault, the requests that ended in it, 429s, failures (by
cause), hangs, responses without a row and the time to recover; then each invariant with
its figure.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import queue
import random
import secrets
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from contextlib import ExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import pytest
from sqlalchemy import Engine, create_engine, inspect, text

from backend.wire import SECRET_HEADER
from tenants import db, keys
from tenants.limits import LimitSet, PlanTerms
from tenants.pricing import DEFAULT_PRICE
from tenants.quota import RedisQuotaStore, ScopeUsage, month_period, tenant_scope
from tenants.services import ApiKeyService, PlanService, TenantService
from tests.conftest import eventually
from tests.e2e.processes import Process, free_port, start
from tests.support.fake_stripe import FakeStripe
from tests.support.servers import OwnPostgres, OwnRedis

TEST_BOUND_S = 420  # the test's own bound, under pytest-timeout's: it says where it waited
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(TEST_BOUND_S + 60)]

ROOT = Path(__file__).resolve().parents[2]
LEASE_S = 3  # short: a killed gateway's reservations come back quickly
RATE_PER_S = 5.0  # open loop: one request every 200 ms whatever the answers
MAX_REQUESTS = 1_000  # the load is bounded in count as well as in time
MAX_TOKENS = 12
LONG_TOKENS = 4_000  # the streams a kill lands in the middle of (capped by the context)
REQUEST_TIMEOUT_S = 20.0  # the client's limit; the server's (TOLLGATE_REQUEST_TIMEOUT_S) is 15
RECOVERY_BOUND_S = 15.0  # stated bound: answering again this long after a fault at most
BASELINE_S = 8.0
STEADY_S = 5.0  # load kept on after each recovery, so late failures show
EXPORT_INTERVAL_S = 2
CHECKPOINT_MS = 500  # gateways that checkpoint running streams do it this often
CHECKPOINTS = "usage_checkpoints"  # where they do
ROWS_GRACE_S = 30.0  # for the rows of streams a killed gateway was serving
STRIPE_KEY = "sk_test_fake"
GATEWAY_LOST = "gateway_lost"  # the error of a row written for a dead gateway's stream
CUT = ("RemoteProtocolError", "ReadError")  # a connection the gateway's death cut
PROMPTS = ("Return the", "The cat", "Create a list of", "This is", "Once upon a time")


# --- the stack ---------------------------------------------------------------------------


@dataclass
class Node:
    """A tollgate process the supervisor can kill and start again on the same port."""

    args: list[str]
    env: dict[str, str]
    ready: str  # a line its output shows once it serves
    port: int
    log: Path
    process: Process | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        if self.process is not None:
            self._keep_output()
        self.process = start([*self.args, "--port", str(self.port)], self.env)

    def wait_ready(self) -> None:
        assert self.process is not None
        self.process.wait_for(self.ready)

    def restart(self) -> None:
        """What a supervisor does once the process died: start it again, wait till ready."""
        self.start()
        self.wait_ready()

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
            self._keep_output()

    def _keep_output(self) -> None:
        """Append what this run wrote to `log` (every run of the node: a post-mortem)."""
        assert self.process is not None
        self.process.popen.wait(timeout=30)
        with contextlib.suppress(queue.Empty):
            while True:
                self.process.output.append(self.process.lines.get(timeout=0.2))
        with self.log.open("a") as file:
            file.write(self.process.text)


@dataclass
class Worker:
    """The Celery worker with its embedded beat, in a session of its own so SIGKILL
    reaches both."""

    env: dict[str, str]
    folder: Path
    popen: subprocess.Popen[bytes] | None = None
    runs: itertools.count[int] = field(default_factory=itertools.count)

    def start(self) -> None:
        schedule = self.folder / f"beat-{next(self.runs)}"
        queue = self.env["TOLLGATE_CELERY_QUEUE"]  # and its batch queue, named after it
        command = [sys.executable, "-m", "celery", "-A", "gateway.billing.worker", "worker",
                   "-B", "-s", str(schedule), "-Q", f"{queue},{queue}-batches",
                   "-P", "solo", "--loglevel", "WARNING", "--without-gossip",
                   "--without-mingle", "--without-heartbeat"]  # fmt: skip
        with (self.folder / "worker.log").open("a") as log:  # the child keeps its own copy
            self.popen = subprocess.Popen(
                command,
                cwd=ROOT,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def kill(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGKILL)
        if self.popen is not None:
            self.popen.wait(timeout=10)


@dataclass
class Tenant:
    role: str  # capped, metered or roomy (see _make_tenants)
    name: str
    id: str
    key: str
    budget_micros: int
    tpm: int


@dataclass
class Stack:
    postgres: OwnPostgres
    redis: OwnRedis
    fake: FakeStripe
    backends: list[Node]
    gateways: list[Node]
    worker: Worker
    secret: str
    ledger: Engine
    logs: Path  # every process's output, kept when it stops
    tenants: list[Tenant] = field(default_factory=list)
    model: str = ""
    max_model_len: int = 0


def _common_env(postgres: OwnPostgres, redis: OwnRedis, secret: str) -> dict[str, str]:
    return {
        "TOLLGATE_DATABASE_URL": postgres.url,
        "TOLLGATE_REDIS_URL": redis.url,
        "TOLLGATE_BACKEND_SECRET": secret,
        "TOLLGATE_MODEL": os.environ.get("TOLLGATE_TEST_MODEL", ""),
        "TOLLGATE_ENGINE_THREADS": "1",  # two replicas share two cores with everything else
        "TOLLGATE_LOG_LEVEL": "warning",
    }


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    folder = tmp_path_factory.mktemp("faults")
    with ExitStack() as cleanup:
        postgres = OwnPostgres(free_port())
        cleanup.callback(postgres.remove)
        postgres.start()
        redis = OwnRedis(free_port())
        cleanup.callback(redis.stop)
        redis.start()
        fake = cleanup.enter_context(FakeStripe(hang_s=1.0).serving())
        db.upgrade(postgres.url)
        secret, (admin_key, _) = secrets.token_hex(16), keys.generate_key()
        common = _common_env(postgres, redis, secret)
        backends = [
            Node(["backend", "serve"], common, "ready on", free_port(), folder / f"backend-{i}.log")
            for i in range(2)
        ]
        gateway_env = {
            **common,
            "TOLLGATE_BACKENDS": ",".join(node.url for node in backends),
            "TOLLGATE_ADMIN_KEY": admin_key,
            "TOLLGATE_LEASE_S": str(LEASE_S),
            "TOLLGATE_REQUEST_TIMEOUT_S": "15",
            "TOLLGATE_CHECKPOINT_MS": str(CHECKPOINT_MS),
            "TOLLGATE_DATA_DIR": str(folder / "gateway"),
        }
        gateways = [
            Node(["serve"], gateway_env, '"model"', free_port(), folder / f"gateway-{i}.log")
            for i in range(2)
        ]
        worker_env = {
            **os.environ,
            **common,
            "TOLLGATE_CELERY_QUEUE": f"tollgate-faults-{uuid.uuid4().hex[:8]}",
            "TOLLGATE_STRIPE_API_KEY": STRIPE_KEY,
            "TOLLGATE_STRIPE_BASE_URL": fake.url,
            "TOLLGATE_STRIPE_TIMEOUT_S": "1",
            "TOLLGATE_STRIPE_RETRY_BASE_MS": "20",
            "TOLLGATE_EXPORT_INTERVAL_S": str(EXPORT_INTERVAL_S),
            "TOLLGATE_EXPORT_RETRY_S": "1",  # a row Stripe deferred is retried a second later
        }
        worker = Worker(worker_env, folder)
        for node in [*backends, *gateways]:
            cleanup.callback(node.stop)
        cleanup.callback(worker.kill)
        for node in backends:
            node.start()
        for node in backends:
            node.wait_ready()
        for node in gateways:
            node.start()
        for node in gateways:
            node.wait_ready()
        worker.start()
        ledger = create_engine(postgres.url, pool_pre_ping=True)
        cleanup.callback(ledger.dispose)
        yield Stack(postgres, redis, fake, backends, gateways, worker, secret, ledger, folder)


async def _make_tenants(stack: Stack, worst_micros: int, worst_tokens: int) -> None:
    """Three tenants on budgets and TPM limits: one whose budget runs out early in the
    run, one whose TPM limit refuses part of its load, one with room to spare (it also
    sends the probes and the long streams)."""
    limits = {
        "capped": LimitSet(monthly_budget_micros=5 * worst_micros, tpm=100 * worst_tokens),
        "metered": LimitSet(monthly_budget_micros=10**9, tpm=15 * worst_tokens),
        "roomy": LimitSet(monthly_budget_micros=10**9, tpm=10**6),
    }
    engine = db.create_engine(stack.postgres.url)
    try:
        async with db.session_factory(engine).begin() as session:
            for role, limit in limits.items():
                name = f"{role}-{uuid.uuid4().hex[:6]}"
                await PlanService(session).create(name, PlanTerms(limits=limit))
                await TenantService(session).create(name)
                tenant = await TenantService(session).set_plan(name, name)
                secret = (await ApiKeyService(session).create(tenant)).secret
                assert limit.monthly_budget_micros is not None and limit.tpm is not None
                stack.tenants.append(
                    Tenant(role, name, tenant.id, secret, limit.monthly_budget_micros, limit.tpm)
                )
    finally:
        await engine.dispose()


# --- the load ----------------------------------------------------------------------------


@dataclass
class Result:
    tenant: str  # its role
    stream: bool
    started: float
    probe: bool = False
    ended: float = 0.0
    status: int | None = None  # HTTP status; None: no answer (connection error, hang)
    outcome: str = ""  # completed, partial, cancelled (hung up on), refused, failed, hung
    response_id: str | None = None  # the one the client read: ties it to its ledger row
    completion_tokens: int | None = None  # from the answer's usage, when whole
    chunks: int = 0  # streamed chunks with text
    tokens_read: int = 0  # the tokens those chunks carried (one chunk may carry several)
    detail: str = ""
    hang_up: bool = False  # set: the client closes the stream at its next chunk

    @property
    def bad(self) -> bool:
        return self.outcome in ("partial", "failed", "hung")

    @property
    def request_id(self) -> str | None:
        if self.response_id is None:
            return None
        return "req_" + self.response_id.split("-", 1)[1]


class Load:
    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.results: list[Result] = []
        self.rng = random.Random(13)
        self.turn = itertools.count()
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=2.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=0),
        )
        self.stopped = asyncio.Event()
        self.tasks: set[asyncio.Task[Result]] = set()

    async def run(self) -> None:
        """Open loop: a request every 1 / RATE_PER_S seconds, answered or not."""
        begin = asyncio.get_running_loop().time()
        for index in range(MAX_REQUESTS):
            due = begin + index / RATE_PER_S
            try:
                async with asyncio.timeout_at(due):
                    await self.stopped.wait()
                return
            except TimeoutError:
                pass
            tenant = self.stack.tenants[index % len(self.stack.tenants)]
            body = self.body(stream=self.rng.random() < 0.5)
            self.spawn(tenant, body, chat=self.rng.random() < 0.5)

    def body(self, stream: bool, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.stack.model, "max_tokens": max_tokens}
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        return body

    def spawn(
        self,
        tenant: Tenant,
        body: dict[str, Any],
        chat: bool = False,
        gateway: int | None = None,
        probe: bool = False,
        on_chunk: Callable[[Result], None] | None = None,
        prompt: str | None = None,
    ) -> asyncio.Task[Result]:
        prompt = prompt or self.rng.choice(PROMPTS)
        if chat:
            path, body = (
                "/v1/chat/completions",
                body | {"messages": [{"role": "user", "content": prompt}]},
            )
        else:
            path, body = "/v1/completions", body | {"prompt": prompt}
        if body.get("stream"):  # a chunk's logprobs list its tokens: the client counts them
            body |= {"logprobs": True} if chat else {"logprobs": 0}
        result = Result(tenant.role, bool(body.get("stream")), time.monotonic(), probe)
        self.results.append(result)
        task = asyncio.create_task(self._send(result, tenant, path, body, gateway, on_chunk))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def _send(
        self,
        result: Result,
        tenant: Tenant,
        path: str,
        body: dict[str, Any],
        gateway: int | None,
        on_chunk: Callable[[Result], None] | None,
    ) -> Result:
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                await self._post(result, tenant, path, body, gateway, on_chunk)
        except TimeoutError:
            result.outcome, result.detail = "hung", "no end within the client's timeout"
        except httpx.HTTPError as exc:  # the connection refused, reset or cut: a clean end
            result.outcome = "partial" if result.chunks else "failed"
            result.detail = type(exc).__name__
        except (ValueError, KeyError) as exc:  # an answer that is not what the API says
            result.outcome, result.detail = "failed", f"unreadable answer: {exc!r:.60}"
        result.ended = time.monotonic()
        return result

    async def _post(
        self,
        result: Result,
        tenant: Tenant,
        path: str,
        body: dict[str, Any],
        gateway: int | None,
        on_chunk: Callable[[Result], None] | None,
    ) -> None:
        """Like a load balancer: a gateway refusing connections is skipped (nothing was
        sent to it, so trying the next is safe); `gateway` pins one."""
        gateways = self.stack.gateways
        first = next(self.turn) if gateway is None else gateway
        order = [first % len(gateways)]
        if gateway is None:
            order += [(first + step) % len(gateways) for step in range(1, len(gateways))]
        headers = {"Authorization": f"Bearer {tenant.key}"}
        for attempt, index in enumerate(order):
            url = gateways[index].url + path
            try:
                async with self.http.stream("POST", url, json=body, headers=headers) as response:
                    await _read(result, response, on_chunk)
                return
            except httpx.ConnectError:
                if attempt == len(order) - 1:
                    raise

    async def probe(self) -> bool:
        """One whole request from the roomy tenant: does the service answer?"""
        roomy = self.stack.tenants[2]
        result = await self.spawn(roomy, self.body(stream=False, max_tokens=2), probe=True)
        return result.outcome == "completed"

    async def finish(self) -> None:
        self.stopped.set()
        while self.tasks:
            await asyncio.gather(*list(self.tasks))
        await self.http.aclose()


async def _read(
    result: Result, response: httpx.Response, on_chunk: Callable[[Result], None] | None
) -> None:
    result.status = response.status_code
    if response.status_code != 200:
        body = (await response.aread()).decode(errors="replace")
        result.outcome = "refused" if response.status_code == 429 else "failed"
        result.detail = f"{response.status_code} {_error_code(body)}"
        return
    if not result.stream:
        answer = json.loads(await response.aread())
        result.response_id = answer["id"]
        result.completion_tokens = answer["usage"]["completion_tokens"]
        result.outcome = "completed"
        return
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            result.outcome = "completed"
            return
        event = json.loads(data)
        if "error" in event:
            result.outcome = "partial" if result.chunks else "failed"
            result.detail = "event " + _error_code(json.dumps(event))
            return
        result.response_id = result.response_id or event.get("id")
        if event.get("usage"):
            result.completion_tokens = event["usage"]["completion_tokens"]
        choices = event.get("choices") or []
        result.tokens_read += sum(_tokens(choice) for choice in choices)
        if any(_text(choice) for choice in choices):
            result.chunks += 1
            if on_chunk is not None:
                on_chunk(result)
        if result.hang_up:
            result.outcome = "cancelled"
            return
    result.outcome = "partial" if result.chunks else "failed"
    result.detail = "stream ended without [DONE]"


def _text(choice: dict[str, Any]) -> str:
    return str(choice.get("text") or (choice.get("delta") or {}).get("content") or "")


def _tokens(choice: dict[str, Any]) -> int:
    """How many tokens a streamed choice carries, from its logprobs (chat: `content`,
    completions: `tokens`)."""
    logprobs = choice.get("logprobs") or {}
    return len(logprobs.get("content") or logprobs.get("tokens") or [])


def _error_code(body: str) -> str:
    """The error's code and the start of its message, to group failures by cause."""
    try:
        error = json.loads(body)["error"]
        return f"{error.get('code') or error.get('type')} ({str(error.get('message'))[:48]})"
    except (ValueError, KeyError, TypeError):
        return body[:60]


# --- observing the budget ----------------------------------------------------------------


@dataclass
class Watch:
    over: dict[str, int] = field(default_factory=dict)  # tenant -> largest excess seen
    stats_s: list[tuple[float, float]] = field(default_factory=list)  # (when, latency)

    def slowest_stats_s(self, begin: float, end: float) -> float:
        return round(max((s for t, s in self.stats_s if begin <= t < end), default=0.0), 2)


@asynccontextmanager
async def _watching(stack: Stack, found: Watch) -> AsyncIterator[None]:
    """Sample each tenant's spent + reserved in Redis, keeping the largest excess over
    its budget (a sample that fails while Redis is down is skipped), and time the
    replicas' /internal/stats (what the gateways poll, with a 1 s timeout, for health)."""
    store = RedisQuotaStore.from_url(stack.redis.url)
    http = httpx.AsyncClient(timeout=10.0, headers={SECRET_HEADER: stack.secret})

    stopped = asyncio.Event()  # ends the loops even where a client swallowed a cancel

    async def budgets() -> None:
        while not stopped.is_set():
            for tenant in stack.tenants:
                with contextlib.suppress(Exception):  # Redis restarting: nothing to read
                    usage = await store.usage(tenant_scope(tenant.id), month_period())
                    over = usage.spent_micros + usage.reserved_micros - tenant.budget_micros
                    found.over[tenant.role] = max(found.over.get(tenant.role, over), over)
            await asyncio.sleep(0.25)  # the sampling period, not synchronisation

    async def stats() -> None:
        while not stopped.is_set():
            for node in stack.backends:
                began = time.monotonic()
                with contextlib.suppress(httpx.HTTPError):  # a killed replica: no sample
                    await http.get(f"{node.url}/internal/stats")
                    found.stats_s.append((began, time.monotonic() - began))
            await asyncio.sleep(0.25)  # the sampling period

    tasks = [asyncio.create_task(budgets()), asyncio.create_task(stats())]
    try:
        yield
    finally:
        # A cancel that lands as a client's own timeout expires can come out as its
        # TimeoutError, which the client retries (Python 3.11's asyncio.timeout): the
        # flag, not the cancel alone, is what ends the loops.
        stopped.set()
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks, timeout=15)
        await store.aclose()
        await http.aclose()


async def _usage(stack: Stack, tenant: Tenant) -> ScopeUsage:
    store = RedisQuotaStore.from_url(stack.redis.url)
    try:
        return await store.usage(tenant_scope(tenant.id), month_period())
    finally:
        await store.aclose()


class LedgerRow(NamedTuple):
    tenant_id: str
    status: str
    tokens: int  # completion tokens billed
    cost: int
    error: str | None


def _ledger_rows(stack: Stack) -> dict[str, LedgerRow]:
    """The ledger by request id."""
    with stack.ledger.connect() as connection:
        rows = connection.execute(
            text(
                "SELECT request_id, tenant_id, status, completion_tokens, cost_micros, error"
                " FROM usage_events"
            )
        )
        return {row[0]: LedgerRow(row[1], row[2], int(row[3]), int(row[4]), row[5]) for row in rows}


def _ledger_spent(stack: Stack) -> dict[str, int]:
    totals: Counter[str] = Counter()
    for row in _ledger_rows(stack).values():
        totals[row.tenant_id] += row.cost
    return {tenant.role: totals[tenant.id] for tenant in stack.tenants}


def _outbox(stack: Stack) -> Counter[str]:
    with stack.ledger.connect() as connection:
        rows = connection.execute(text("SELECT status, count(*) FROM usage_outbox GROUP BY 1"))
        return Counter({row[0]: int(row[1]) for row in rows})


def _stripe_totals(stack: Stack) -> dict[str, int]:
    """The fake's total per customer, by tenant role."""
    with stack.ledger.connect() as connection:
        rows = connection.execute(text("SELECT customer_id, tenant_id FROM stripe_customers"))
        customers = {row[0]: row[1] for row in rows}
    names = {tenant.id: tenant.role for tenant in stack.tenants}
    return {names[customers[c]]: v for c, v in stack.fake.customer_totals().items() if v}


# --- the faults --------------------------------------------------------------------------


@dataclass
class Phase:
    name: str
    begun: float  # requests that end from here on (until the next phase) are this phase's
    injected: float = 0.0
    answered: float | None = None  # when the service answered a probe again
    resumed: float | None = None  # for the export: when Stripe got events again
    ended: float = 0.0
    notes: dict[str, Any] = field(default_factory=dict)


# A fault injects itself, sets `phase.injected`, and returns what the supervisor does next
# (restart what was killed), which runs while the service is probed.
Aftermath = Coroutine[Any, Any, None] | None
Fault = Callable[[Stack, Load, Phase], Awaitable[Aftermath]]


async def _restart_redis(stack: Stack, load: Load, phase: Phase) -> Aftermath:
    phase.injected = time.monotonic()
    await asyncio.to_thread(stack.redis.restart)
    return None


async def _restart_postgres(stack: Stack, load: Load, phase: Phase) -> Aftermath:
    phase.injected = time.monotonic()
    await asyncio.to_thread(stack.postgres.restart)
    return None


def _long_streams(
    load: Load, count: int, gateway: int | None
) -> tuple[list[Result], asyncio.Event]:
    """`count` long streams from the roomy tenant, all with one prompt (so one replica's
    affinity); the event is set once each has streamed two chunks (or ended)."""
    roomy, going = load.stack.tenants[2], asyncio.Event()
    results: list[Result] = []

    def check(_: object = None) -> None:
        if len(results) == count and all(r.chunks >= 2 or r.ended for r in results):
            going.set()

    long_tokens = min(LONG_TOKENS, load.stack.max_model_len - 32)
    for _ in range(count):
        body = load.body(stream=True, max_tokens=long_tokens) | {"ignore_eos": True}
        task = load.spawn(roomy, body, gateway=gateway, on_chunk=check, prompt=PROMPTS[-1])
        results.append(load.results[-1])
        task.add_done_callback(check)
    return results, going


async def _cut(streams: list[Result]) -> int:
    """Hang up on the long streams a kill did not cut; returns how many it cut."""
    for result in streams:
        result.hang_up = True
    await eventually(lambda: all(r.ended for r in streams), timeout_s=REQUEST_TIMEOUT_S)
    return sum(r.outcome == "partial" for r in streams)


async def _kill_backend(stack: Stack, load: Load, phase: Phase) -> Aftermath:
    """Kill the busier replica once four long streams are flowing there."""
    streams, going = _long_streams(load, 4, gateway=None)
    await asyncio.wait_for(going.wait(), REQUEST_TIMEOUT_S)
    running = [await _running(stack, node) for node in stack.backends]
    victim = stack.backends[running.index(max(running))]
    victim.kill()
    phase.injected = time.monotonic()
    phase.notes["running on it"] = max(running)

    async def supervise() -> None:
        await asyncio.to_thread(victim.restart)  # by then the cut streams have ended
        phase.notes["long streams cut"] = await _cut(streams)

    return supervise()


async def _running(stack: Stack, node: Node) -> int:
    async with httpx.AsyncClient(timeout=2.0) as http:
        stats = await http.get(f"{node.url}/internal/stats", headers={SECRET_HEADER: stack.secret})
        return int(stats.json()["num_running"])


async def _kill_gateway(stack: Stack, load: Load, phase: Phase) -> Aftermath:
    """Kill a gateway serving two long streams: one it has recorded in a checkpoint
    (where gateways checkpoint running streams), one that has just begun."""
    older, going = _long_streams(load, 1, gateway=0)
    await asyncio.wait_for(going.wait(), REQUEST_TIMEOUT_S)
    if _keeps_checkpoints(stack):
        await eventually(lambda: _checkpointed(stack, older[0]), timeout_s=REQUEST_TIMEOUT_S)
    newer, going = _long_streams(load, 1, gateway=0)
    await asyncio.wait_for(going.wait(), REQUEST_TIMEOUT_S)
    victim = stack.gateways[0]
    victim.kill()
    phase.injected = time.monotonic()
    phase.notes["chunks read"] = [r.chunks for r in (*older, *newer)]

    async def supervise() -> None:
        await asyncio.to_thread(victim.restart)
        phase.notes["restart s"] = round(time.monotonic() - phase.injected, 1)
        phase.notes["streams cut"] = await _cut([*older, *newer])

    return supervise()


def _keeps_checkpoints(stack: Stack) -> bool:
    return inspect(stack.ledger).has_table(CHECKPOINTS)


def _checkpointed(stack: Stack, result: Result) -> bool:
    with stack.ledger.connect() as connection:
        query = text(f"SELECT count(*) FROM {CHECKPOINTS} WHERE request_id = :id")
        return bool(connection.execute(query, {"id": result.request_id}).scalar())


async def _kill_worker(stack: Stack, load: Load, phase: Phase) -> Aftermath:
    """Catch the worker mid-export: the fake holds its meter-event calls once two more
    events are in, so the kill lands with a call in flight (and, most often, a batch
    half sent)."""
    fake = stack.fake
    with fake.lock:
        fake.release = threading.Event()
        fake.held = 0
        fake.hold_after = len(fake.events) + 2
    await eventually(lambda: fake.held > 0, timeout_s=30)
    stack.worker.kill()
    phase.injected = time.monotonic()
    fake.release.set()
    phase.notes["sent, not marked"] = _sent_unmarked(stack)
    before = fake.accepted()

    async def supervise() -> None:
        stack.worker.start()
        await eventually(lambda: fake.accepted() > before, timeout_s=RECOVERY_BOUND_S + 30)
        phase.resumed = time.monotonic()

    return supervise()


def _sent_unmarked(stack: Stack) -> int:
    """Events Stripe has whose outbox rows are still pending: a batch cut halfway."""
    with stack.ledger.connect() as connection:
        rows = connection.execute(
            text("SELECT usage_event_id FROM usage_outbox WHERE status = 'pending'")
        )
        unmarked = {row[0] for row in rows}
    return sum(1 for identifier in list(stack.fake.events) if identifier[9:] in unmarked)


FAULTS: list[tuple[str, Fault | None]] = [
    ("baseline", None),
    ("restart Redis", _restart_redis),
    ("restart PostgreSQL", _restart_postgres),
    ("SIGKILL a backend mid-stream", _kill_backend),
    ("SIGKILL a gateway", _kill_gateway),
    ("SIGKILL Celery mid-export", _kill_worker),
]


async def _run_phase(stack: Stack, load: Load, name: str, fault: Fault | None) -> Phase:
    phase = Phase(name, begun=time.monotonic(), injected=time.monotonic())
    if fault is None:
        await asyncio.sleep(BASELINE_S)  # the load runs meanwhile: the phase's length
    else:
        aftermath = await fault(stack, load, phase)
        supervisor = asyncio.create_task(aftermath) if aftermath is not None else None
        deadline = phase.injected + RECOVERY_BOUND_S + 15
        while time.monotonic() < deadline:
            if await load.probe():
                phase.answered = time.monotonic()
                break
            await asyncio.sleep(0.2)  # the probing period
        if supervisor is not None:
            await supervisor
        await asyncio.sleep(STEADY_S)  # the load goes on: late failures would show
    phase.ended = time.monotonic()
    capped = stack.tenants[0]
    phase.notes["capped spent"] = f"{_ledger_spent(stack)[capped.role]}/{capped.budget_micros}"
    return phase


# --- the test ----------------------------------------------------------------------------


@dataclass
class Row:
    phase: str
    ended: int  # requests the client saw end in this phase
    refused: int  # 429s: the tenants' limits at work
    failed: int  # 5xx, a cut stream, a refused connection
    hung: int  # no end within the client's timeout
    unrecorded: int  # a response the client read without its ledger row
    recover_s: float | None
    detail: str


@asynccontextmanager
async def _bounded(seconds: float) -> AsyncIterator[None]:
    """Fail after `seconds` with every task's stack printed: what the test waited on."""
    try:
        async with asyncio.timeout(seconds):
            yield
    except TimeoutError:
        for task in asyncio.all_tasks():
            task.print_stack(limit=6, file=sys.stderr)
        raise


async def test_faults_under_load(stack: Stack) -> None:
    async with _bounded(TEST_BOUND_S):
        await _run_the_faults(stack)


async def _run_the_faults(stack: Stack) -> None:
    await _learn_model(stack)
    prompt_tokens = 8  # the longest prompt above, with room for the chat template
    worst_micros = DEFAULT_PRICE.cost_micros(prompt_tokens * 3, 0, MAX_TOKENS)
    await _make_tenants(stack, worst_micros, prompt_tokens * 3 + MAX_TOKENS)
    load = Load(stack)
    watch = Watch()
    phases: list[Phase] = []
    async with _watching(stack, watch):
        runner = asyncio.create_task(load.run())
        try:
            for name, fault in FAULTS:
                print(f"{time.strftime('%X')} phase: {name}", file=sys.stderr)
                phases.append(await _run_phase(stack, load, name, fault))
        finally:
            await load.finish()
            await runner
    if phases:
        phases[-1].ended = time.monotonic()  # the last phase has the requests still running
    print(f"{time.strftime('%X')} the load has ended: invariants", file=sys.stderr)
    invariants = await _invariants(stack, load.results, watch.over)
    rows = _phase_rows(phases, load.results, set(_ledger_rows(stack)), watch)
    _print(rows, phases, invariants, load.results)
    print(f"process logs (written when the stack stops): {stack.logs}")

    for row in rows:
        assert row.hung == 0, f"{row.phase}: {row.hung} requests hung"
        if row.phase != "baseline":
            assert row.recover_s is not None and row.recover_s <= RECOVERY_BOUND_S, row
    assert next(r for r in rows if r.phase == "baseline").failed == 0
    assert not [r for r in load.results if r.outcome == "hung"]  # probes and the last ones too
    refusals = _refusals(load.results)
    assert refusals["capped insufficient_quota"] and refusals["metered rate_limit_exceeded"], (
        refusals  # both limits were at work
    )
    notes = {phase.name: phase.notes for phase in phases}
    assert notes["SIGKILL a backend mid-stream"]["long streams cut"] >= 1
    assert notes["SIGKILL a gateway"]["streams cut"] == 2
    failed = {name: value for name, (value, ok) in invariants.items() if not ok}
    assert not failed, failed


async def _learn_model(stack: Stack) -> None:
    headers = {"Authorization": f"Bearer {stack.gateways[0].env['TOLLGATE_ADMIN_KEY']}"}
    async with httpx.AsyncClient(timeout=30) as http:
        models = await http.get(f"{stack.gateways[0].url}/v1/models", headers=headers)
    card = models.json()["data"][0]
    stack.model, stack.max_model_len = card["id"], card["max_model_len"]


def _phase_rows(
    phases: list[Phase], results: list[Result], ledger: set[str], watch: Watch
) -> list[Row]:
    """A request belongs to the phase in which the client saw it end; a phase recovered
    once a probe was answered and no later request failed in it."""
    rows = []
    for phase in phases:
        phase.notes["slowest stats s"] = watch.slowest_stats_s(phase.begun, phase.ended)
        mine = [r for r in results if not r.probe and phase.begun <= r.ended < phase.ended]
        bad = [r for r in mine if r.bad]
        recover_s = None
        if phase.answered is not None:
            last = max([phase.answered, phase.resumed or 0.0, *(r.ended for r in bad)])
            recover_s = round(last - phase.injected, 1)
        kinds = Counter(f"{r.outcome}:{r.detail}" for r in bad)
        rows.append(
            Row(
                phase.name,
                len(mine),
                sum(r.outcome == "refused" for r in mine),
                len(bad),
                sum(r.outcome == "hung" for r in mine),
                sum(r.request_id is not None and r.request_id not in ledger for r in mine),
                recover_s if phase.name != "baseline" else 0.0,
                ", ".join(f"{k} x{n}" for k, n in kinds.most_common(4)),
            )
        )
    return rows


async def _invariants(
    stack: Stack, results: list[Result], worst_over: dict[str, int]
) -> dict[str, tuple[Any, bool]]:
    """name -> (figure, holds)."""
    found: dict[str, tuple[Any, bool]] = {}

    async def reserved() -> dict[str, int]:
        return {t.role: (await _usage(stack, t)).reserved_micros for t in stack.tenants}

    async def drift() -> dict[str, int]:
        ledger = _ledger_spent(stack)
        return {
            t.role: (await _usage(stack, t)).spent_micros - ledger[t.role] for t in stack.tenants
        }

    # A figure, not an invariant (settles may still be landing): the store's spend as
    # the load ends, which a lost and unrebuilt spend leaves far below the ledger.
    found["spent - ledger as the load ends (figure)"] = (await drift(), True)
    # A gateway killed mid-stream leaves rows for another gateway to write (from what it
    # recorded of the streams) once its record is stale: give them ROWS_GRACE_S.
    received = {r.request_id for r in results if r.request_id is not None}
    began = time.monotonic()
    await _settle(lambda: received <= set(_ledger_rows(stack)), ROWS_GRACE_S)
    found.update(_rows_per_response(stack, results, time.monotonic() - began))
    # Leases of a killed gateway run out within a few leases; the store catches up with
    # the ledger by itself (reconciler, rebuild). Each gets a bounded wait, then is read.
    found["reserved back to 0"] = await _converge(reserved, 4 * LEASE_S + 10)
    found["spent - ledger"] = await _converge(drift, 10)
    spent = _ledger_spent(stack)
    capped = stack.tenants[0]
    over = spent[capped.role] - capped.budget_micros
    found["capped: ledger - budget (micros)"] = (
        f"{over} ({spent[capped.role]} spent of {capped.budget_micros})",
        over <= 0,
    )
    over = max(spent[t.role] - t.budget_micros for t in stack.tenants)
    found["any tenant: ledger - budget (max)"] = (over, over <= 0)
    found["spent + reserved - budget in the store, sampled (max)"] = (
        max(worst_over.values()),
        max(worst_over.values()) <= 0,
    )
    await _settle(lambda: _exported(stack), 30)
    outbox = _outbox(stack)
    found["outbox not exported"] = (
        dict(outbox - Counter({"exported": outbox["exported"]})),
        set(outbox) <= {"exported"},
    )
    ledger = {name: cost for name, cost in _ledger_spent(stack).items() if cost}
    stripe = _stripe_totals(stack)
    found["stripe - ledger per customer"] = (
        {name: stripe.get(name, 0) - ledger.get(name, 0) for name in {*ledger, *stripe}},
        stripe == ledger,
    )
    billed = sum(1 for row in _ledger_rows(stack).values() if row.cost)
    found["stripe events - billed rows"] = (
        stack.fake.accepted() - billed,
        stack.fake.accepted() == billed,
    )
    return found


def _rows_per_response(
    stack: Stack, results: list[Result], waited_s: float
) -> dict[str, tuple[Any, bool]]:
    rows = _ledger_rows(stack)
    received = [r for r in results if r.request_id is not None]
    missing = [r for r in received if r.request_id not in rows]
    wrong = [r for r in received if r.request_id in rows and not _agrees(r, rows[r.request_id])]
    seen = {r.request_id for r in received}
    unseen_billed = [row for rid, row in rows.items() if row.cost and rid not in seen]
    # A whole answer's row is durable before the answer is sent (never an answer without
    # its row), so a gateway SIGKILLed in between bills an answer its client lost with the
    # connection (a window of milliseconds). Only such rows may be unseen, at most one per
    # request the kill cut before any answer reached its client.
    cut_unanswered = sum(r.outcome == "failed" and r.detail in CUT for r in results)
    committed_then_cut = all(row.status == "completed" for row in unseen_billed)
    lost = [f"{r.tokens_read} read, {rows[r.request_id].tokens} billed" for r in received
            if r.request_id in rows and rows[r.request_id].error == GATEWAY_LOST]  # fmt: skip
    return {
        "responses without a ledger row": (f"{len(missing)} after {waited_s:.1f} s", not missing),
        "rows whose status/tokens differ from the response": (len(wrong), not wrong),
        "billed rows no client received (whole answers cut by the gateway kill)": (
            f"{len(unseen_billed)} of {cut_unanswered} cut: "
            f"{[(row.status, row.tokens, row.error) for row in unseen_billed]}",
            committed_then_cut and len(unseen_billed) <= cut_unanswered,
        ),
        "streams of the killed gateway billed from a checkpoint": (lost, True),  # a figure
    }


def _agrees(result: Result, row: LedgerRow) -> bool:
    """A whole answer is a completed row with its tokens; anything less is a row that is
    not completed and bills at least the tokens the client read, but for a stream of a
    gateway that died, billed from its last checkpoint: at most what the client read (up to
    an interval less)."""
    if result.outcome == "completed":
        return row.status == "completed" and row.tokens == result.completion_tokens
    if row.error == GATEWAY_LOST:
        return row.status != "completed" and row.tokens <= result.tokens_read
    return row.status != "completed" and row.tokens >= result.tokens_read


async def _converge(
    read: Callable[[], Awaitable[dict[str, int]]], timeout_s: float
) -> tuple[str, bool]:
    """Wait up to `timeout_s` for every figure to be 0; say where they started and ended."""
    first, began = await read(), time.monotonic()
    await _settle(lambda: _all_zero(read), timeout_s)
    last = await read()
    took = f"after {time.monotonic() - began:.1f} s" if not any(last.values()) else "still"
    return f"{last} {took} (first read: {first})", not any(last.values())


async def _all_zero(read: Callable[[], Awaitable[dict[str, int]]]) -> bool:
    try:
        return not any((await read()).values())
    except Exception:  # a store still reconnecting: not yet
        return False


def _exported(stack: Stack) -> bool:
    return set(_outbox(stack)) <= {"exported"}


async def _settle(check: Callable[[], Any], timeout_s: float) -> None:
    """Give the stack up to `timeout_s` to reach a state; the caller then asserts it."""
    with contextlib.suppress(AssertionError):
        await eventually(check, timeout_s=timeout_s)


def _refusals(results: list[Result]) -> Counter[str]:
    """(tenant role, error code) of the 429s."""
    return Counter(f"{r.tenant} {r.detail.split()[1]}" for r in results if r.outcome == "refused")


def _print(
    rows: list[Row],
    phases: list[Phase],
    invariants: dict[str, tuple[Any, bool]],
    results: list[Result],
) -> None:
    outcomes = Counter(r.outcome for r in results if not r.probe)
    refusals = _refusals(results)
    lines = [
        "",
        f"faults under load: {len(results)} requests ({dict(outcomes)}), "
        f"recovery bound {RECOVERY_BOUND_S:g} s; refusals {dict(refusals)}",
        f"{'fault':<30} {'ended':>5} {'429':>4} {'failed':>6} {'hung':>4} {'no row':>6}"
        f" {'recover s':>9}  notes",
    ]
    for row, phase in zip(rows, phases, strict=True):
        recover = "-" if row.recover_s is None else f"{row.recover_s:.1f}"
        notes = "; ".join(f"{k}={v}" for k, v in phase.notes.items())
        lines.append(
            f"{row.phase:<30} {row.ended:>5} {row.refused:>4} {row.failed:>6} {row.hung:>4}"
            f" {row.unrecorded:>6} {recover:>9}  {notes}"
        )
        if row.detail:
            lines.append(f"{'':<30} failures: {row.detail}")
    lines.append("invariants at the end:")
    for name, (value, ok) in invariants.items():
        lines.append(f"  {'ok  ' if ok else 'FAIL'} {name}: {value}")
    print("\n".join(lines))
