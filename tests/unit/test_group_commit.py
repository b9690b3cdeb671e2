"""Group commit (the recorder's ledger rows, batch lines' results): writes that arrive
during a commit go together in the next one, each submitter returns after its own write's
commit, and one bad write fails only its submitter."""

from __future__ import annotations

import asyncio

import pytest

from gateway.core.group_commit import GroupCommit
from gateway.core.tasks import TaskSet
from gateway.metering.recorder import Checkpoint, Write


def _write(name: str) -> Checkpoint:
    return Checkpoint(frozenset({name}))


async def test_writes_arriving_during_a_commit_share_the_next_one() -> None:
    groups: list[list[Write]] = []
    committing = asyncio.Event()
    release = asyncio.Event()

    async def commit(writes: list[Write]) -> None:
        groups.append(writes)
        committing.set()
        await release.wait()

    writes = GroupCommit(commit, TaskSet())
    first = asyncio.create_task(writes.submit(_write("a")))
    await committing.wait()
    later = [asyncio.create_task(writes.submit(_write(name))) for name in ("b", "c")]
    release.set()  # they queued (they ran first: asyncio runs ready work in order)
    await asyncio.gather(first, *later)
    assert groups == [[_write("a")], [_write("b"), _write("c")]]


async def test_a_bad_write_fails_only_its_own_submitter() -> None:
    committed: list[Write] = []
    release = asyncio.Event()

    async def commit(writes: list[Write]) -> None:
        await release.wait()
        if _write("bad") in writes:
            raise ValueError("refused by the database")
        committed.extend(writes)

    writes = GroupCommit(commit, TaskSet())
    first = asyncio.create_task(writes.submit(_write("first")))
    group = [asyncio.create_task(writes.submit(_write(n))) for n in ("good", "bad", "fine")]
    release.set()
    results = await asyncio.gather(first, *group, return_exceptions=True)
    assert [type(r) for r in results] == [type(None), type(None), ValueError, type(None)]
    assert committed == [_write("first"), _write("good"), _write("fine")]


async def test_a_failing_commit_reaches_the_submitter() -> None:
    async def commit(writes: list[Write]) -> None:
        raise OSError("database away")

    with pytest.raises(OSError, match="database away"):
        await GroupCommit(commit, TaskSet()).submit(_write("a"))


async def test_a_final_error_reaches_every_submitter_without_a_retry() -> None:
    """A group committed but unsynced must not be written again line by line."""
    commits: list[list[Write]] = []
    committing, release = asyncio.Event(), asyncio.Event()

    async def commit(writes: list[Write]) -> None:
        commits.append(writes)
        committing.set()
        await release.wait()
        if len(writes) > 1:
            raise LookupError("committed, then the sync failed")

    writes = GroupCommit(commit, TaskSet(), final=(LookupError,))
    first = asyncio.create_task(writes.submit(_write("first")))
    await committing.wait()
    group = [asyncio.create_task(writes.submit(_write(n))) for n in ("a", "b")]
    release.set()
    results = await asyncio.gather(first, *group, return_exceptions=True)
    assert [type(r) for r in results] == [type(None), LookupError, LookupError]
    assert commits == [[_write("first")], [_write("a"), _write("b")]]  # no retry one by one
