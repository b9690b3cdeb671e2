"""Batches in Celery workers (stack mode). A task `tollgate.batches.run(batch_id)` runs one
batch with the embedded runner's own code (gateway/batches/runner.py, restricted to that
batch): the same claims, leases, per-line admission, dispatch and settlement, the same
finalizing. It runs until the batch is final or TOLLGATE_BATCH_TASK_S passed, then queues
its sequel. One task holds a batch at a time (a leased Redis key, renewed while it runs);
the others queued for it return at once. The tasks go to a queue of their own
(TOLLGATE_CELERY_BATCH_QUEUE), served by workers of their own: a run holds its worker slot
for minutes, and the billing relay must not wait behind it.

A worker killed mid-batch loses nothing: its lines' results already kept stay kept; its
lines under way are taken over once their lease lapses (TOLLGATE_BATCH_LEASE_S). A line
killed after its ledger row and before its result was kept (a few milliseconds) runs
again, unbilled: its key is in the ledger, so no line is billed twice. Beat's sweep
(`tollgate.batches.sweep`, every TOLLGATE_BATCH_SWEEP_S, and once as a worker starts)
queues a run for every unfinished batch, so the batch of a dead task is picked up again
without a redelivery.

The tasks need the gateway's runtime (database, Redis, the engine or its replicas, the
file store): each worker process opens one at its first task, on an event loop in a
thread of its own, and keeps it for the next."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any, TypeVar

from celery import Celery
from celery.signals import worker_process_shutdown, worker_ready, worker_shutdown
from redis.asyncio import Redis
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.batches.tasks import RUN_TASK, SWEEP_TASK
from gateway.settings import Settings
from tenants.db import run_once
from tenants.quota.redis import connect as connect_redis

if TYPE_CHECKING:  # the runtime's modules (the engine's among them) load at the first task:
    from gateway.runtime import Runtime  # the billing tasks' worker starts without them

log = logging.getLogger(__name__)

T = TypeVar("T")

# KEYS[1] = the batch's run key; ARGV[1] = our token; ARGV[2] = the lease in ms.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class RunLock:
    """Which task runs a batch now: a Redis key per batch, leased so that a killed worker's
    batch is free again one lease later, renewed every third of a lease while it runs."""

    def __init__(self, redis: Redis, lease_s: float, prefix: str = "tg:batch-run:") -> None:
        self.redis = redis
        self.lease_ms = max(1, int(lease_s * 1000))
        self.prefix = prefix
        self._renew = redis.register_script(_RENEW)
        self._release = redis.register_script(_RELEASE)

    @contextlib.asynccontextmanager
    async def holding(self, batch_id: str) -> AsyncIterator[bool]:
        """Yields True while this task holds the batch, False when another does."""
        key, token = self.prefix + batch_id, secrets.token_hex(8)
        if not await self.redis.set(key, token, nx=True, px=self.lease_ms):
            yield False
            return
        renewing = asyncio.get_running_loop().create_task(self._renewing(key, token))
        try:
            yield True
        finally:
            renewing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewing
            await self._release(keys=[key], args=[token])

    async def _renewing(self, key: str, token: str) -> None:
        while True:
            await asyncio.sleep(self.lease_ms / 3000)
            try:
                if not await self._renew(keys=[key], args=[token, self.lease_ms]):
                    # Lapsed (Redis stalled past a lease): a second task may run the batch
                    # too. Harmless, lines are claimed one runner at a time: carry on.
                    log.warning("the run lock of %s lapsed", key)
            except Exception:  # Redis away for a moment: the next renewal tries again
                log.exception("renewing %s failed", key)


async def run_batch(runtime: Runtime, batch_id: str, budget_s: float) -> bool:
    """Run the batch with the embedded runner's code until it is final or `budget_s` has
    passed; the lines under way then finish (or go back to pending). True: not final."""
    from gateway.app import embedded_runner

    runner = embedded_runner(runtime, only=batch_id)
    runner.start()
    try:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(runner.idle.wait(), budget_s)
    finally:
        await runner.close()
    return not runner.idle.is_set()


async def unfinished_batches(session: AsyncSession) -> list[str]:
    from tenants.batches import BatchQueue

    return [batch.id for batch in await BatchQueue(session).active()]


class BatchHost:
    """A worker process's runtime, on an event loop in a thread of its own: opened at the
    first task (after a prefork worker forked its child), kept for the next tasks, closed
    as the process ends."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._guard = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stack: AsyncExitStack | None = None
        self._opened: tuple[Runtime, RunLock] | None = None

    def call(self, work: Callable[[Runtime, RunLock], Coroutine[Any, Any, T]]) -> T:
        loop, (runtime, lock) = self._open()
        return asyncio.run_coroutine_threadsafe(work(runtime, lock), loop).result()

    def _open(self) -> tuple[asyncio.AbstractEventLoop, tuple[Runtime, RunLock]]:
        with self._guard:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                thread = threading.Thread(
                    target=self._loop.run_forever, name="batch-runtime", daemon=True
                )
                thread.start()
            if self._opened is None:
                opening = asyncio.run_coroutine_threadsafe(self._open_runtime(), self._loop)
                self._opened = opening.result()
            return self._loop, self._opened

    async def _open_runtime(self) -> tuple[Runtime, RunLock]:
        from gateway.app import open_worker_runtime  # the app's modules: at the first task

        stack = AsyncExitStack()
        try:
            runtime = await open_worker_runtime(self.settings, stack)
            assert self.settings.redis_url is not None
            redis = connect_redis(self.settings.redis_url)
            stack.push_async_callback(redis.aclose)
        except BaseException:  # half opened: close that half, the next task tries again
            await stack.aclose()
            raise
        self._stack = stack
        return runtime, RunLock(redis, self.settings.batch_lease_s)

    def close(self) -> None:
        with self._guard:
            loop, stack = self._loop, self._stack
            self._loop = self._stack = self._opened = None
        if loop is None:
            return
        if stack is not None:
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(stack.aclose(), loop).result(timeout=60)
        loop.call_soon_threadsafe(loop.stop)


def batch_routes(queue: str) -> dict[str, dict[str, str]]:
    return {RUN_TASK: {"queue": queue}, SWEEP_TASK: {"queue": queue}}


def register_batch_tasks(celery: Celery, settings: Settings) -> None:
    """The batch tasks on the worker's app, beat's sweep in its schedule, and a sweep as a
    worker starts (what a dead worker left is queued again at once)."""
    host = BatchHost(settings)
    queue = settings.celery_batch_queue
    # Sent without a queue (by hand, or by another app): the batch queue all the same.
    celery.conf.task_routes = {**(celery.conf.task_routes or {}), **batch_routes(queue)}
    budget_s = float(settings.batch_task_s)

    def run(batch_id: str) -> str:
        async def held(runtime: Runtime, lock: RunLock) -> str:
            async with lock.holding(batch_id) as ours:
                if not ours:
                    return "busy"  # another task runs it: this one is a duplicate
                return "more" if await run_batch(runtime, batch_id, budget_s) else "final"

        outcome = host.call(held)
        if outcome == "more":  # the budget ran out: the sequel picks up where this stopped
            run_task.apply_async((batch_id,), queue=queue)
        return outcome

    def sweep() -> int:
        # The database alone: the runtime would wait for the engine or its replicas, and
        # the worker's other tasks (the ledger's export) behind it.
        batch_ids = run_once(settings.database_url, unfinished_batches)
        for batch_id in batch_ids:
            run_task.apply_async((batch_id,), queue=queue, expires=settings.batch_sweep_s)
        return len(batch_ids)

    run_task = celery.task(name=RUN_TASK, acks_late=True, shared=False)(run)
    sweep_task = celery.task(name=SWEEP_TASK, acks_late=True, shared=False)(sweep)
    celery.conf.beat_schedule["batch-sweep"] = {
        "task": SWEEP_TASK,
        "schedule": float(settings.batch_sweep_s),
        "options": {"queue": queue, "expires": settings.batch_sweep_s},
    }

    def sweep_at_start(sender: Any, **_: Any) -> None:
        if sender.app is celery:
            sweep_task.apply_async(queue=queue, expires=settings.batch_sweep_s)

    def close_host(**_: Any) -> None:
        host.close()

    worker_ready.connect(sweep_at_start, weak=False)
    worker_process_shutdown.connect(close_host, weak=False)
    worker_shutdown.connect(close_host, weak=False)
