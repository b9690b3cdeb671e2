"""Group commit: writes that arrive while one commit is under way go together in the next,
so a burst of small writes costs a few transactions, not one each (the ledger's rows,
gateway/metering/recorder.py; batch lines' results, gateway/batches/runner.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from gateway.core.tasks import TaskSet

W = TypeVar("W")


class GroupCommit(Generic[W]):
    """Writes submitted while a commit is under way wait, and go together in the next one;
    each submitter returns once the commit holding its write is done. A group that fails
    is retried write by write, so one bad write fails only its own submitter; unless the
    error is one of `final` (the group was committed): then every submitter hears it."""

    def __init__(
        self,
        commit: Callable[[list[W]], Awaitable[None]],
        tasks: TaskSet,
        final: tuple[type[Exception], ...] = (),
    ) -> None:
        self.commit = commit
        self.tasks = tasks  # the committer is tracked: shutdown waits for it
        self.final = final
        self._waiting: list[tuple[W, asyncio.Future[None]]] = []
        self._committer: asyncio.Task[None] | None = None

    async def submit(self, write: W) -> None:
        done = asyncio.get_running_loop().create_future()
        self._waiting.append((write, done))
        if self._committer is None:
            self._committer = self.tasks.spawn(self._commit_waiting())
        await asyncio.shield(done)  # a cancelled submitter does not cancel the others'

    async def _commit_waiting(self) -> None:
        group: list[tuple[W, asyncio.Future[None]]] = []
        try:
            while self._waiting:
                group, self._waiting = self._waiting, []
                await self._commit_group(group)
        except BaseException as exc:  # cancelled (shutdown cut short): nobody waits forever
            for _, done in [*group, *self._waiting]:
                resolve(done, exc)
            raise
        finally:
            self._committer = None

    async def _commit_group(self, group: list[tuple[W, asyncio.Future[None]]]) -> None:
        try:
            await self.commit([write for write, _ in group])
        except Exception as exc:
            if len(group) == 1 or isinstance(exc, self.final):  # nothing to try again
                for _, done in group:
                    resolve(done, exc)
                return
            for waiting in group:
                await self._commit_group([waiting])
            return
        for _, done in group:
            resolve(done, None)


def resolve(done: asyncio.Future[None], error: BaseException | None) -> None:
    """Settle `done` with `error` (None: success), unless it is settled already."""
    if done.done():
        return
    if error is None:
        done.set_result(None)
    else:
        done.set_exception(error)
