"""Load shedding end to end: with max_num_seqs=1 and max_waiting_requests=1, a third
concurrent request finds the engine's queue full and gets 503 + Retry-After, in process
(through the official openai client) and from a remote backend over its HTTP API; a more
urgent third request takes the queued one's place instead (the queued one gets the 503);
and the load a gateway reads off a remote replica."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from backend import AsyncEngine, EngineConfig, SamplingParams
from backend.builtin import BUILTIN_MODEL_DIR
from backend.errors import RequestStepError
from backend.server import create_backend_app
from gateway.app import create_app
from gateway.core.errors import InternalError, Overloaded
from gateway.dispatch.engine_client import GenerateRequest, InProcessEngineClient
from gateway.dispatch.remote import RemoteEngineClient
from gateway.settings import Settings
from tenants.models import UsageEvent, UsageStatus
from tests.conftest import eventually, serving

ONE_AT_A_TIME = EngineConfig(max_num_seqs=1, max_waiting_requests=1, cpu_threads=1)
# Outlasts any test (a few seconds even on a fast machine); every test cancels it.
LONG = SamplingParams(max_tokens=1800, ignore_eos=True, temperature=0)


@pytest.fixture
async def small_engine() -> AsyncIterator[InProcessEngineClient]:
    client = await InProcessEngineClient.load(BUILTIN_MODEL_DIR, ONE_AT_A_TIME)
    yield client
    await client.close()


class Chats:
    """The official openai client, through a gateway in front of the small engine."""

    def __init__(self, client: openai.AsyncOpenAI, engine: InProcessEngineClient) -> None:
        self.client = client
        self.model = engine.model_name
        self.stats = engine.engine.stats

    async def create(
        self, max_tokens: int = LONG.max_tokens, stream: bool = False, **extra: Any
    ) -> Any:
        return await self.client.chat.completions.create(
            model=self.model,
            messages=[{"role": "user", "content": "Tell me about sorting."}],
            max_tokens=max_tokens,
            stream=stream,
            extra_body={"ignore_eos": True, **extra},
        )


@pytest.fixture
async def chats(
    settings: Settings, tenant_key: str, small_engine: InProcessEngineClient
) -> AsyncIterator[Chats]:
    app = create_app(settings, engine_client=small_engine)
    async with serving(app) as base_url:
        client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=tenant_key, max_retries=0)
        yield Chats(client, small_engine)
        await client.close()


async def _rejected_rows(sessions: async_sessionmaker[AsyncSession]) -> list[tuple[str, int, int]]:
    """(status, completion tokens, cost) of the requests settled as rejected."""
    columns = (UsageEvent.status, UsageEvent.completion_tokens, UsageEvent.cost_micros)
    async with sessions() as session:
        rows = await session.execute(select(*columns))
        return [(s, t, c) for s, t, c in rows if s == UsageStatus.REJECTED]


async def _count_rejected(sessions: async_sessionmaker[AsyncSession], n: int) -> bool:
    return len(await _rejected_rows(sessions)) == n


async def _cancel(*tasks: asyncio.Task[Any]) -> None:
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError, openai.APIError):
            await task


async def test_a_full_queue_gets_503_with_retry_after(
    chats: Chats, sessions: async_sessionmaker[AsyncSession]
) -> None:
    stats = chats.stats
    running = asyncio.create_task(chats.create())
    await eventually(lambda: stats().num_running == 1)
    waiting = asyncio.create_task(chats.create())
    await eventually(lambda: stats().num_waiting == 1)
    try:
        with pytest.raises(openai.InternalServerError) as caught:
            await chats.create()
        assert caught.value.status_code == 503
        assert int(caught.value.response.headers["retry-after"]) >= 1
        assert caught.value.code == "overloaded"
        assert stats().num_rejected_overloaded == 1
        # A stream sends nothing before the engine's first output: the same 503.
        with pytest.raises(openai.InternalServerError) as streamed:
            await chats.client.chat.completions.create(
                model=chats.model,
                messages=[{"role": "user", "content": "Hi"}],
                stream=True,
            )
        assert streamed.value.status_code == 503
        assert int(streamed.value.response.headers["retry-after"]) >= 1
        await eventually(lambda: _count_rejected(sessions, 2))
        assert await _rejected_rows(sessions) == [("rejected", 0, 0)] * 2  # billed nothing
        assert stats().num_rejected_overloaded == 2
        assert stats().num_running == 1 and stats().num_waiting == 1  # nobody was lost
    finally:
        await _cancel(running, waiting)


async def test_an_urgent_request_displaces_a_queued_batch_one(
    chats: Chats, sessions: async_sessionmaker[AsyncSession]
) -> None:
    stats = chats.stats
    running = asyncio.create_task(chats.create(priority=0))
    await eventually(lambda: stats().num_running == 1)
    batch = asyncio.create_task(chats.create(priority=5))
    await eventually(lambda: stats().waiting_tokens > 0)  # in the engine's queue
    urgent = asyncio.create_task(chats.create(priority=0))
    try:
        with pytest.raises(openai.InternalServerError) as caught:
            await batch
        assert caught.value.status_code == 503 and caught.value.code == "overloaded"
        assert int(caught.value.response.headers["retry-after"]) >= 1
        await eventually(lambda: stats().waiting_tokens > 0)  # the urgent one took its place
        assert (stats().num_running, stats().num_waiting) == (1, 1)
        assert stats().num_rejected_overloaded == 1
        await eventually(lambda: _count_rejected(sessions, 1))
        assert [(s, c) for s, _, c in await _rejected_rows(sessions)] == [("rejected", 0)]
    finally:
        await _cancel(running, urgent)


async def test_a_first_token_deadline_fails_fast_behind_a_busy_engine(chats: Chats) -> None:
    stats = chats.stats
    with pytest.raises(openai.BadRequestError) as invalid:
        await chats.create(1, ttft_deadline_ms=0)
    assert invalid.value.param == "ttft_deadline_ms"
    running = asyncio.create_task(chats.create())
    await eventually(lambda: stats().num_running == 1)
    try:
        for stream in (False, True):  # a stream sends nothing before its first token
            with pytest.raises(openai.InternalServerError) as caught:
                await chats.create(4, stream=stream, ttft_deadline_ms=50)
            assert caught.value.status_code == 504 and caught.value.code == "deadline_exceeded"
        await eventually(lambda: stats().num_waiting == 0)  # gone from the engine too
        assert stats().num_running == 1
    finally:
        await _cancel(running)
    reply = await chats.create(4, ttft_deadline_ms=60_000)  # an idle engine meets it
    assert reply.usage.completion_tokens == 4


async def test_a_remote_backend_sheds_with_a_typed_error(tmp_path: Path) -> None:
    engine = AsyncEngine.from_pretrained(BUILTIN_MODEL_DIR, ONE_AT_A_TIME)
    app = create_backend_app(engine, BUILTIN_MODEL_DIR, secret="s3cret")
    async with serving(app) as url:
        remote = await RemoteEngineClient.connect([url], "s3cret", tmp_path)

        async def drain(request_id: str) -> None:
            async for _ in remote.generate(GenerateRequest([1, 2, 3], LONG, request_id)):
                pass

        tasks = [asyncio.create_task(drain("first"))]
        await eventually(lambda: engine.stats().num_running == 1)
        tasks.append(asyncio.create_task(drain("second")))
        await eventually(lambda: engine.stats().num_waiting == 1)
        try:
            with pytest.raises(Overloaded) as caught:
                await drain("third")
            assert caught.value.status == 503 and int(caught.value.headers["Retry-After"]) >= 1
            assert engine.stats().num_rejected_overloaded == 1
        finally:
            await _cancel(*tasks)
            await remote.close()


async def test_remote_replica_load_snapshot_follows_its_stats(tmp_path: Path) -> None:
    """What the gateway learns from a replica's stats (routing load, the console's
    prefix-cache hit rate and engine time) is what the replica's engine reports."""
    engine = AsyncEngine.from_pretrained(BUILTIN_MODEL_DIR, ONE_AT_A_TIME)
    app = create_backend_app(engine, BUILTIN_MODEL_DIR, secret="s3cret")
    async with serving(app) as url:
        remote = await RemoteEngineClient.connect([url], "s3cret", tmp_path)
        try:
            short = SamplingParams(max_tokens=2, temperature=0)
            for request_id in ("a", "b"):  # the same 40-token prompt: b hits the cache
                async for _ in remote.generate(
                    GenerateRequest(list(range(3, 43)), short, request_id)
                ):
                    pass
            await remote.refresh()
            [replica] = remote.replicas
            stats = engine.stats()
            assert stats.prefix_cache_hits > 0
            assert replica.healthy and replica.prefix_cache_hit_rate == stats.prefix_cache_hit_rate
            assert replica.kv_used_fraction == stats.kv_blocks_used / stats.kv_blocks_total
            # The console's engine time: these requests were interactive (the step loop
            # may have stepped since the poll).
            assert 0 < replica.busy_s <= stats.busy_s and replica.batch_busy_s == 0
        finally:
            await remote.close()


async def test_a_request_a_replica_failed_is_not_retried_elsewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step fault the engine pins on one request fails that request with 500
    `request_failed`; the replica stays healthy and the request is not sent to the next
    replica, where it could fail the same way."""
    engines = [AsyncEngine.from_pretrained(BUILTIN_MODEL_DIR, ONE_AT_A_TIME) for _ in range(2)]
    for engine in engines:  # a fault pinned on one request, as a bad seed was
        execute = engine.engine.runner.execute

        def failing(batch: Any, execute: Any = execute) -> Any:
            if any(r.request_id == "poison" for r in batch.requests):
                raise RequestStepError(["poison"], "injected")
            return execute(batch)

        monkeypatch.setattr(engine.engine.runner, "execute", failing)
    params = SamplingParams(max_tokens=2, temperature=0)
    apps = [create_backend_app(engine, BUILTIN_MODEL_DIR, secret="s3cret") for engine in engines]
    async with serving(apps[0]) as first, serving(apps[1]) as second:
        remote = await RemoteEngineClient.connect([first, second], "s3cret", tmp_path)
        try:
            with pytest.raises(InternalError) as caught:
                async for _ in remote.generate(GenerateRequest([1, 2, 3], params, "poison")):
                    pass
            assert caught.value.code == "request_failed"
            assert sorted(e.engine.num_failed_requests for e in engines) == [0, 1]
            assert all(replica.healthy for replica in remote.replicas)
            after = GenerateRequest([1, 2, 3], params, "after")
            assert [o async for o in remote.generate(after)][-1].finished
        finally:
            await remote.close()
