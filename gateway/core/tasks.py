"""Background work: what a request leaves behind (ledger writes, lock releases), tracked
so a client disconnect cannot cut it short and shutdown waits for it; and the periodic
jobs of a gateway process."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


class TaskSet:
    def __init__(self) -> None:
        self._pending: set[asyncio.Task[Any]] = set()

    def spawn(self, work: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task = asyncio.get_running_loop().create_task(work)
        self._pending.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._pending.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed", exc_info=task.exception())

    async def drain(self) -> None:
        while self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)


class Interrupt:
    """A cancellation of the current task that the task can tell from any other, as
    asyncio.timeout does: `fire()` it from a callback (a timer, a watcher); in the task's
    `except CancelledError`, `ours()` is true only if it fired and no other cancellation
    is pending (which then propagates). Cheaper than a task and a race per wait."""

    __slots__ = ("_before", "fired", "task")

    def __init__(self) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.task, self._before, self.fired = task, task.cancelling(), False

    def fire(self) -> None:
        if not self.fired:
            self.fired = True
            self.task.cancel()

    def ours(self) -> bool:
        return self.fired and self.task.uncancel() <= self._before


Job = Callable[[], Awaitable[object]]


class Periodic:
    """Runs each job every `period_s` seconds until closed; a failure is logged and the
    job runs again at its next turn."""

    def __init__(self, jobs: list[tuple[Job, float]]) -> None:
        self.jobs = jobs
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks += [loop.create_task(_every(period_s, job)) for job, period_s in self.jobs]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def _every(period_s: float, job: Job) -> None:
    while True:
        await asyncio.sleep(period_s)  # a schedule, not synchronisation
        try:
            await job()
        except Exception:
            log.exception("periodic job %s failed", getattr(job, "__name__", job))
