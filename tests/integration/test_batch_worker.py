"""Batches in stack mode: a gateway on PostgreSQL and Redis stores the batch and queues a
Celery task; a real Celery worker process (its embedded beat, its own in-process engine on
the built-in model) runs the lines, and the files live in an S3 bucket on a real
S3-compatible server on loopback (moto's), so the input file the gateway stored is what
the worker reads, and the output file the worker wrote is what the gateway serves.
A worker SIGKILLed mid-batch and another started: exactly one result and exactly one
usage row per line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any

import openai
import pytest
from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.app import create_app
from gateway.batches.tasks import CeleryBatches
from gateway.batches.worker import RunLock
from gateway.dispatch.engine_client import InProcessEngineClient
from gateway.settings import Settings
from tenants.batches import Batch, BatchLine, BatchQueue, LineStatus
from tenants.blobs import S3Location, s3_client
from tenants.models import UsageEvent, as_utc, utcnow
from tenants.quota.redis import connect as connect_redis
from tests.conftest import POSTGRES_URL, REDIS_URL, eventually, migrated_postgres, serving
from tests.support.batches import chat_lines, submit
from tests.support.s3 import s3_env, s3_server

ROOT = Path(__file__).resolve().parents[2]
LEASE_S = 3  # a dead worker's lines and batch are taken over this soon
LOST_ANSWERS = 3  # finished lines the kill is made to catch before their answers were stored


@pytest.fixture
def database_url() -> str:
    return migrated_postgres()


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Location]:
    with s3_server() as location:
        yield location


@pytest.fixture
def worker_env(s3: S3Location, tmp_path: Path) -> dict[str, str]:
    """The stack's settings, shared by the gateway (through Settings.from_env) and the
    workers: the test database, Redis, a Celery queue of its own, the S3 bucket."""
    return {
        "TOLLGATE_DATABASE_URL": POSTGRES_URL,
        "TOLLGATE_REDIS_URL": REDIS_URL,
        "TOLLGATE_CELERY_QUEUE": f"tollgate-batches-{uuid.uuid4().hex[:12]}",
        "TOLLGATE_DATA_DIR": str(tmp_path / "worker-data"),
        "TOLLGATE_BATCH_LEASE_S": str(LEASE_S),
        "TOLLGATE_BATCH_SWEEP_S": "1",
        "TOLLGATE_LOG_LEVEL": "warning",
        **s3_env(s3),
    }


@pytest.fixture
def settings(worker_env: dict[str, str], tmp_path: Path) -> Settings:
    stack = Settings.from_env(worker_env)
    return replace(stack, data_dir=tmp_path / "gateway-data")  # nothing shared on disk


@pytest.fixture
async def client(
    settings: Settings, engine_client: InProcessEngineClient, tenant_key: str
) -> AsyncIterator[openai.AsyncOpenAI]:
    app = create_app(settings, engine_client=engine_client)
    async with serving(app) as url:
        assert isinstance(app.state.batch_runner, CeleryBatches)  # the gateway runs no line
        yield openai.AsyncOpenAI(base_url=url + "/v1", api_key=tenant_key, max_retries=0)


def _queues(env: dict[str, str]) -> str:
    """The billing queue and the batch queue (its name derived from the first)."""
    settings = Settings.from_env(env)
    return f"{settings.celery_queue},{settings.celery_batch_queue}"


class Worker:
    """A Celery worker process with its embedded beat, in a session of its own so that a
    SIGKILL reaches both."""

    def __init__(self, env: dict[str, str], schedule: Path) -> None:
        command = [
            sys.executable, "-m", "celery", "-A", "gateway.billing.worker", "worker",
            "-B", "-s", str(schedule), "-Q", _queues(env), "-P", "solo",
            "--loglevel", "WARNING", "--without-gossip", "--without-mingle",
            "--without-heartbeat",
        ]  # fmt: skip
        self.process = subprocess.Popen(
            command, cwd=ROOT, env={**os.environ, **env}, start_new_session=True
        )

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    """The workers a test started (start_worker), all killed at its end."""
    started: list[Worker] = []
    try:
        yield started
    finally:
        for worker in started:
            worker.kill()


def start_worker(workers: list[Worker], env: dict[str, str], tmp_path: Path) -> Worker:
    worker = Worker(env, tmp_path / f"beat-{len(workers)}")
    workers.append(worker)
    return worker


async def _completed(client: openai.AsyncOpenAI, batch_id: str, timeout_s: float) -> Any:
    found: dict[str, Any] = {}

    async def final() -> bool:
        found["batch"] = await client.batches.retrieve(batch_id)
        return found["batch"].status in ("completed", "failed", "expired", "cancelled")

    await eventually(final, timeout_s=timeout_s)
    return found["batch"]


async def _records(client: openai.AsyncOpenAI, file_id: str) -> list[dict[str, Any]]:
    content = await client.files.content(file_id)
    return [json.loads(line) for line in content.text.splitlines()]


async def _billed(sessions: async_sessionmaker[AsyncSession]) -> dict[str, datetime]:
    """The batch lines' ledger rows: request id -> when written."""
    async with sessions() as session:
        rows = await session.execute(
            select(UsageEvent.request_id, UsageEvent.created_at).where(
                UsageEvent.endpoint == "batch.chat.completions", UsageEvent.status == "completed"
            )
        )
    return {request_id: as_utc(created) for request_id, created in rows}


async def _billed_keys(
    sessions: async_sessionmaker[AsyncSession],
) -> dict[str | None, list[tuple[str, datetime]]]:
    """The batch lines' ledger rows by Idempotency-Key: (request id, when written)."""
    found: dict[str | None, list[tuple[str, datetime]]] = {}
    async with sessions() as session:
        rows = await session.execute(
            select(UsageEvent.idempotency_key, UsageEvent.request_id, UsageEvent.created_at).where(
                UsageEvent.endpoint == "batch.chat.completions"
            )
        )
    for key, request_id, created in rows:
        found.setdefault(key, []).append((request_id, as_utc(created)))
    return found


async def _lose_answers(
    sessions: async_sessionmaker[AsyncSession], batch_id: str, lines: list[BatchLine]
) -> None:
    """What a worker killed after these lines' ledger commits, before their results were
    kept, leaves: lines running (taken over once their lease lapses), billed, with no
    answer."""
    numbers = [line.line for line in lines]
    async with sessions.begin() as session:
        await session.execute(
            update(BatchLine)
            .where(BatchLine.batch_id == batch_id, BatchLine.line.in_(numbers))
            .values(status=LineStatus.RUNNING, status_code=None, request_id=None, result=None)
        )
        await session.execute(
            update(Batch)
            .where(Batch.id == batch_id)
            .values(completed=Batch.completed - len(numbers))
        )


async def _lines(sessions: async_sessionmaker[AsyncSession], batch_id: str) -> list[BatchLine]:
    async with sessions() as session:
        return await BatchQueue(session).lines(batch_id)


async def test_a_celery_worker_runs_a_batch_with_its_files_in_s3(
    client: openai.AsyncOpenAI,
    engine_client: InProcessEngineClient,
    sessions: async_sessionmaker[AsyncSession],
    workers: list[Worker],
    worker_env: dict[str, str],
    s3: S3Location,
    tmp_path: Path,
) -> None:
    total = 6
    batch = await submit(client, chat_lines(engine_client.model_name, total, max_tokens=4))
    start_worker(workers, worker_env, tmp_path)
    done = await _completed(client, batch.id, timeout_s=120)
    assert done.status == "completed", done
    assert (done.request_counts.completed, done.request_counts.failed) == (total, 0)
    records = await _records(client, done.output_file_id)
    assert sorted(r["custom_id"] for r in records) == sorted(f"line-{i}" for i in range(total))
    assert all(r["response"]["body"]["object"] == "chat.completion" for r in records)
    assert len(await _billed(sessions)) == total
    listed = s3_client(s3).list_objects_v2(Bucket=s3.bucket, Prefix=s3.prefix)
    keys = {o["Key"].rsplit("/", 1)[1] for o in listed["Contents"]}
    assert {batch.input_file_id, done.output_file_id} <= keys  # both in the bucket
    assert not (tmp_path / "gateway-data" / "files").exists()  # nothing on the data folder


@pytest.mark.slow
async def test_a_worker_killed_mid_batch_leaves_one_result_per_line(
    client: openai.AsyncOpenAI,
    engine_client: InProcessEngineClient,
    sessions: async_sessionmaker[AsyncSession],
    workers: list[Worker],
    worker_env: dict[str, str],
    tmp_path: Path,
) -> None:
    total = 60
    batch = await submit(client, chat_lines(engine_client.model_name, total, max_tokens=16))
    first = start_worker(workers, worker_env, tmp_path)

    async def partly_done() -> bool:
        async with sessions() as session:
            stored = await session.get(Batch, batch.id, populate_existing=True)
            return stored is not None and stored.completed >= 5

    await eventually(partly_done, timeout_s=120)
    first.kill()
    killed_at = utcnow()
    left = await _lines(sessions, batch.id)
    in_flight = sum(line.status == LineStatus.RUNNING for line in left)
    assert sum(line.status == LineStatus.SUCCEEDED for line in left) < total, "killed too late"
    succeeded = [line for line in left if line.status == LineStatus.SUCCEEDED]
    await _lose_answers(sessions, batch.id, succeeded[:LOST_ANSWERS])
    start_worker(workers, worker_env, tmp_path)
    done = await _completed(client, batch.id, timeout_s=180)
    assert done.status == "completed", done
    assert (done.request_counts.completed, done.request_counts.failed) == (total, 0)
    records = await _records(client, done.output_file_id)
    assert sorted(r["custom_id"] for r in records) == sorted(f"line-{i}" for i in range(total))
    # Exactly one usage row per line, under its Idempotency-Key: a line the kill caught
    # between its ledger commit and its answer's commit ran again unbilled (a rerun), so
    # its kept result is the rerun's and its row the dead worker's run's; any other line's
    # kept result is the run it was billed for. The kill caught LOST_ANSWERS lines there
    # (made to) and perhaps some of those in flight.
    lines = {f"batch:{batch.id}:{line.line}": line for line in await _lines(sessions, batch.id)}
    billed = await _billed_keys(sessions)
    assert sum(map(len, billed.values())) == total  # billed once a line
    assert sorted(billed, key=str) == sorted(lines)
    assert all(len(rows) == 1 for rows in billed.values()), billed
    reruns = [billed[key][0] for key, line in lines.items() if line.request_id != billed[key][0][0]]
    assert all(at <= killed_at for _, at in reruns)
    assert LOST_ANSWERS <= len(reruns) <= LOST_ANSWERS + in_flight


async def test_one_task_holds_a_batch_and_a_dead_ones_hold_lapses() -> None:
    redis = connect_redis(REDIS_URL)
    lock, other = RunLock(redis, lease_s=0.3), RunLock(redis, lease_s=0.3)
    key = lock.prefix + f"batch_{uuid.uuid4().hex}"
    batch_id = key.removeprefix(lock.prefix)
    ttls: list[int] = []

    async def renewed() -> bool:  # the key's time to live went back up: a renewal
        ttls.append(await redis.pttl(key))
        return len(ttls) > 1 and ttls[-1] > ttls[-2]

    async def lapsed() -> bool:
        return not await redis.exists(key)

    try:
        async with lock.holding(batch_id) as ours:
            assert ours
            async with other.holding(batch_id) as theirs:
                assert not theirs  # a duplicate task returns at once
            await eventually(renewed, timeout_s=2)
        async with other.holding(batch_id) as theirs:
            assert theirs  # released on the way out
        # A holder that died renews nothing: its key lapses within a lease.
        await redis.set(key, "a-dead-worker", px=300)
        async with other.holding(batch_id) as theirs:
            assert not theirs
        await eventually(lapsed, timeout_s=2)
    finally:
        await redis.aclose()
