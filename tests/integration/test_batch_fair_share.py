"""The batch runner's rounds: its fair share (BatchRunner._start_lines), a round's free
slots going to the tenants equally, whoever submitted first, then to a tenant's batches
equally; and a finished batch's `finalizing` round. The
runner here runs its lines with a LineRunner that records each and holds it until
released, so a round's claims stand still to be counted; no engine (no interactive
work to wait for)."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.batches.runner import BatchRunner
from gateway.settings import Settings
from tenants.batches import Batch, BatchLine, BatchStore, LineOutcome, LineStatus, NewLine
from tenants.blobs import FolderBlobStore
from tenants.models import KeyRole
from tenants.services import ApiKeyService, Principal, TenantService
from tests.conftest import eventually

Sessions = async_sessionmaker[AsyncSession]


class HeldLines:
    """A LineRunner that records the batch of every line it is given and answers none
    until `release`."""

    def __init__(self) -> None:
        self.started: list[str] = []  # the batch id of each line, in order
        self.released = asyncio.Event()

    async def __call__(
        self, principal: Principal, endpoint: str, body: dict[str, Any], key: str, priority: int
    ) -> LineOutcome:
        self.started.append(key.split(":")[1])  # batch:<batch id>:<line>
        await self.released.wait()
        return LineOutcome(200, {"ok": True}, None)


@pytest.fixture
def lines() -> HeldLines:
    return HeldLines()


@pytest.fixture
async def runner(
    sessions: Sessions, settings: Settings, lines: HeldLines, tmp_path: Path
) -> AsyncIterator[BatchRunner]:
    runner = BatchRunner(
        sessions, settings, lines, None, FolderBlobStore(tmp_path / "blobs"), concurrency=4
    )
    yield runner
    lines.released.set()
    await runner.close()


async def _batch(sessions: Sessions, tenant: str, count: int = 10) -> str:
    """A batch of `count` lines for `tenant` (made with its first key when it is new)."""
    async with sessions.begin() as session:
        tenants = TenantService(session)
        owner = await tenants.find(tenant) or await tenants.create(tenant)
        key = await ApiKeyService(session).create(owner, "test", KeyRole.TENANT)
        batch = await BatchStore(session, owner.id).create(
            api_key_id=key.key.id,
            endpoint="/v1/chat/completions",
            input_file_id="file-test",
            completion_window="24h",
            metadata=None,
            lines=[NewLine(i, f"line-{i}", {"model": "m"}) for i in range(1, count + 1)],
            enqueued_tokens=0,
            worst_case_micros=0,
        )
        return batch.id


async def _running(sessions: Sessions) -> Counter[str]:
    """Lines claimed (running) by batch."""
    async with sessions() as session:
        rows = await session.execute(
            select(BatchLine.batch_id, func.count())
            .where(BatchLine.status == LineStatus.RUNNING)
            .group_by(BatchLine.batch_id)
        )
        return Counter({row[0]: row[1] for row in rows})


async def _one_round(runner: BatchRunner, sessions: Sessions, lines: HeldLines) -> Counter[str]:
    """The lines one round started, by batch (the lines held: every claimed one running)."""
    before, running = len(lines.started), (await _running(sessions)).total()
    await runner.round()
    claimed = (await _running(sessions)).total() - running
    await eventually(lambda: len(lines.started) - before == claimed)
    return Counter(lines.started[before:])


async def test_a_round_shares_the_slots_between_tenants_not_first_come(
    runner: BatchRunner, sessions: Sessions, lines: HeldLines
) -> None:
    first = await _batch(sessions, "acme")  # submitted first, and enough lines for all slots
    second = await _batch(sessions, "globex")
    assert await _one_round(runner, sessions, lines) == {first: 2, second: 2}
    assert await _one_round(runner, sessions, lines) == {}  # no slot free: nothing more
    lines.released.set()  # the four finish: the next round shares the slots again
    await eventually(lambda: not runner._running)  # their tasks done: four slots free
    lines.released.clear()
    assert await _one_round(runner, sessions, lines) == {first: 2, second: 2}


async def test_a_round_shares_a_tenants_slots_between_its_batches(
    runner: BatchRunner, sessions: Sessions, lines: HeldLines
) -> None:
    older, newer = await _batch(sessions, "acme"), await _batch(sessions, "acme")
    assert await _one_round(runner, sessions, lines) == {older: 2, newer: 2}


async def test_a_tenant_with_two_batches_gets_no_more_than_one_with_one(
    runner: BatchRunner, sessions: Sessions, lines: HeldLines
) -> None:
    older, newer = await _batch(sessions, "acme"), await _batch(sessions, "acme")
    other = await _batch(sessions, "globex")
    assert await _one_round(runner, sessions, lines) == {older: 1, newer: 1, other: 2}


async def test_more_tenants_than_free_slots_take_turns_within_the_cap(
    runner: BatchRunner, sessions: Sessions, lines: HeldLines
) -> None:
    """Six tenants, four slots: a round starts four lines, one for each of the first four
    tenants; once they finish, the two left out go first."""
    batches = [await _batch(sessions, f"tenant-{i}") for i in range(6)]
    assert await _one_round(runner, sessions, lines) == dict.fromkeys(batches[:4], 1)
    lines.released.set()
    await eventually(lambda: not runner._running)
    lines.released.clear()
    second = await _one_round(runner, sessions, lines)
    assert second.total() == runner.concurrency
    assert set(batches[4:]) <= set(second)


async def test_a_finished_batch_is_finalizing_for_a_round_then_completed(
    runner: BatchRunner, sessions: Sessions, lines: HeldLines
) -> None:
    """OpenAI's statuses: in_progress, then finalizing while the files are written (the
    round after the last line), then completed with its output file."""
    batch_id = await _batch(sessions, "acme", count=2)
    assert await _one_round(runner, sessions, lines) == {batch_id: 2}
    lines.released.set()
    await eventually(lambda: not runner._running)
    seen = []
    for _ in range(2):
        await runner.round()
        async with sessions() as session:
            batch = await session.get(Batch, batch_id)
            assert batch is not None
            seen.append((batch.status, batch.finalizing_at is not None, batch.output_file_id))
    assert seen[0] == ("finalizing", True, None)
    assert seen[1][:2] == ("completed", True) and seen[1][2] is not None
