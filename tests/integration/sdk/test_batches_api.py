"""/v1/files and /v1/batches with the official `openai` client against a real server
(in-process engine), on SQLite (embedded) and PostgreSQL (stack): the whole round trip,
a malformed line, tenant isolation, cancel, expiry, the budget's refusal, the plan's cap
on enqueued batch tokens, and a gateway stopped mid-batch that resumes with exactly one
result per line."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import httpx
import openai
import pytest
from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.app import create_app
from gateway.batches.runner import RAMP_LINES
from gateway.dispatch.engine_client import InProcessEngineClient
from gateway.settings import Settings
from tenants.batches import Batch, BatchLine, LineStatus
from tenants.limits import LimitSet, PlanTerms
from tenants.models import IdempotencyRecord, KeyRole, UsageEvent, utcnow
from tenants.pricing import DEFAULT_PRICE
from tenants.services import ApiKeyService, PlanService, TenantService
from tests.conftest import eventually, migrated_postgres, migrated_sqlite, serving
from tests.support.batches import chat_lines, records, submit, until


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Batches run on both: the embedded default and stack mode's database."""
    if request.param == "sqlite":
        return migrated_sqlite(tmp_path / "sdk.db")
    return migrated_postgres()


async def _key(sessions: async_sessionmaker[AsyncSession], tenant: str, plan: str | None) -> str:
    async with sessions.begin() as session:
        created = await TenantService(session).create(tenant, plan)
        return (await ApiKeyService(session).create(created, "test", KeyRole.TENANT)).secret


async def test_a_batch_runs_every_line_once_at_the_batch_price(
    client: openai.AsyncOpenAI,
    base_url: str,
    tenant_key: str,
    engine_client: InProcessEngineClient,
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    model = engine_client.model_name
    batch = await submit(client, chat_lines(model, 5), {"job": "test"})
    assert batch.status == "in_progress" and batch.request_counts.total == 5
    done = await until(client, batch.id, "completed", "failed")
    assert done.status == "completed", done
    counts = (done.request_counts.completed, done.request_counts.failed)
    assert counts == (5, 0), await records(client, done.error_file_id)
    assert done.error_file_id is None and done.metadata == {"job": "test"}
    output = await records(client, done.output_file_id)
    assert sorted(r["custom_id"] for r in output) == [f"line-{i}" for i in range(5)]
    for record in output:
        assert record["error"] is None and record["response"]["status_code"] == 200
        assert record["response"]["body"]["object"] == "chat.completion"
    async with sessions() as session:
        events = list(await session.scalars(select(UsageEvent)))
    assert {e.endpoint for e in events} == {"batch.chat.completions"} and len(events) == 5
    batch_price = DEFAULT_PRICE.for_batch()
    assert batch_price.output_micros_per_mtok == DEFAULT_PRICE.output_micros_per_mtok // 2
    for event in events:
        cost = batch_price.cost_micros(
            event.prompt_tokens, event.cached_tokens, event.completion_tokens
        )
        assert event.cost_micros == cost > 0
        assert event.priority is not None and event.priority > 5  # the batch class
    async with httpx.AsyncClient() as http:
        answer = await http.get(
            f"{base_url}/usage", headers={"Authorization": f"Bearer {tenant_key}"}
        )
    report = answer.json()
    spent = sum(e.cost_micros for e in events)
    assert report["batch"]["cost_micros"] == report["totals"]["cost_micros"] == spent
    assert report["batch"]["requests"] == 5
    listed = await client.batches.list()
    assert [b.id for b in listed.data] == [batch.id]
    files = await client.files.list()
    assert {f.purpose for f in files.data} == {"batch", "batch_output"}
    deleted = await client.files.delete(batch.input_file_id)
    assert deleted.deleted
    with pytest.raises(openai.NotFoundError):
        await client.files.retrieve(batch.input_file_id)


async def test_a_malformed_line_is_refused_naming_its_number(client: openai.AsyncOpenAI) -> None:
    content = b'{"custom_id": "a", "body": {}}\n{"custom_id": "b", "body": \n'
    with pytest.raises(openai.BadRequestError, match="line 2"):
        await client.files.create(file=("bad.jsonl", content), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="purpose"):
        await client.files.create(file=("a.jsonl", b"{}\n"), purpose="fine-tune")


async def test_duplicate_custom_ids_and_other_endpoints_are_refused_at_creation(
    client: openai.AsyncOpenAI, engine_client: InProcessEngineClient
) -> None:
    line = chat_lines(engine_client.model_name, 1)
    uploaded = await client.files.create(file=("dup.jsonl", line + line), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="not unique"):
        await client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    with pytest.raises(openai.BadRequestError, match="url must be"):
        await client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h"
        )


async def test_one_tenant_never_sees_another_tenants_files_or_batches(
    client: openai.AsyncOpenAI,
    base_url: str,
    engine_client: InProcessEngineClient,
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    batch = await submit(client, chat_lines(engine_client.model_name, 1))
    other = openai.AsyncOpenAI(
        base_url=base_url, api_key=await _key(sessions, "globex", None), max_retries=0
    )
    with pytest.raises(openai.NotFoundError):
        await other.files.retrieve(batch.input_file_id)
    with pytest.raises(openai.NotFoundError):
        await other.files.content(batch.input_file_id)
    with pytest.raises(openai.NotFoundError):
        await other.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        await other.batches.cancel(batch.id)
    with pytest.raises(openai.NotFoundError):
        await other.batches.create(
            input_file_id=batch.input_file_id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
        )
    assert (await other.batches.list()).data == [] and (await other.files.list()).data == []
    await until(client, batch.id, "completed")


async def test_cancel_keeps_what_ran_and_reports_the_rest(
    client: openai.AsyncOpenAI, engine_client: InProcessEngineClient
) -> None:
    batch = await submit(client, chat_lines(engine_client.model_name, 400, max_tokens=32))
    cancelling = await client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = await until(client, batch.id, "cancelled")
    counts = done.request_counts
    errors = await records(client, done.error_file_id)
    outputs = await records(client, done.output_file_id)
    assert len(outputs) == counts.completed and counts.completed < 400
    cancelled = [r for r in errors if r["error"] and r["error"]["code"] == "batch_cancelled"]
    assert len(outputs) + len(errors) == 400 and cancelled
    assert done.cancelled_at is not None


async def test_a_batch_expires_at_its_window_with_what_is_done(
    client: openai.AsyncOpenAI,
    engine_client: InProcessEngineClient,
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    batch = await submit(client, chat_lines(engine_client.model_name, 400, max_tokens=32))
    async with sessions.begin() as session:
        await session.execute(update(Batch).where(Batch.id == batch.id).values(expires_at=utcnow()))
    done = await until(client, batch.id, "expired")
    errors = await records(client, done.error_file_id)
    assert errors and all(r["error"]["code"] == "batch_expired" for r in errors)
    assert done.request_counts.completed + len(errors) == 400
    assert done.expired_at is not None


async def test_lines_claimed_after_the_key_is_revoked_fail_and_the_batch_finishes(
    client: openai.AsyncOpenAI,
    engine_client: InProcessEngineClient,
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    """The key that created a batch is revoked while it runs: the lines claimed from then
    on fail as unauthenticated (the key is read once per claim), the batch still finishes,
    and every line has exactly one answer."""
    batch = await submit(client, chat_lines(engine_client.model_name, 400, max_tokens=32))
    async with sessions.begin() as session:
        created = await session.get(Batch, batch.id)
        assert created is not None
        await ApiKeyService(session).revoke(created.api_key_id)

    async def finished() -> bool:
        async with sessions() as session:
            row = await session.get(Batch, batch.id, populate_existing=True)
            return row is not None and row.status == "completed"

    await eventually(finished, timeout_s=120)
    async with sessions() as session:
        query = select(BatchLine.status_code).where(BatchLine.batch_id == batch.id)
        codes = list((await session.execute(query)).scalars())
    assert len(codes) == 400 and set(codes) <= {200, 401} and 401 in codes


async def test_a_batch_over_the_budget_is_refused_at_creation(
    base_url: str,
    engine_client: InProcessEngineClient,
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    async with sessions.begin() as session:
        terms = PlanTerms(name="small", limits=LimitSet(monthly_budget_micros=50))
        await PlanService(session).create("small", terms)
    poor = openai.AsyncOpenAI(
        base_url=base_url, api_key=await _key(sessions, "poor", "small"), max_retries=0
    )
    with pytest.raises(openai.APIStatusError) as refused:
        await submit(poor, chat_lines(engine_client.model_name, 50))
    assert refused.value.status_code == 402
    assert "batch_over_budget" in str(refused.value.body)
    assert (await poor.batches.list()).data == []


@pytest.mark.parametrize(
    "metadata", [{str(i): "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}]
)
async def test_metadata_past_openais_bounds_is_refused(
    client: openai.AsyncOpenAI, engine_client: InProcessEngineClient, metadata: dict[str, str]
) -> None:
    """16 pairs, keys of 64 characters, values of 512 (a live gateway stored any size)."""
    uploaded = await client.files.create(
        file=("in.jsonl", chat_lines(engine_client.model_name, 1)), purpose="batch"
    )
    with pytest.raises(openai.BadRequestError) as refused:
        await client.batches.create(
            input_file_id=uploaded.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            metadata=metadata,
        )
    assert "metadata" in str(refused.value.body)
    assert (await client.batches.list()).data == []


async def test_a_batch_on_a_model_the_plan_excludes_is_refused_at_creation(
    base_url: str,
    engine_client: InProcessEngineClient,
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    """Not accepted and then failed line by line with 403s (found on a live gateway)."""
    async with sessions.begin() as session:
        terms = PlanTerms(name="narrow", allowed_models=frozenset({"another-model"}))
        await PlanService(session).create("narrow", terms)
    narrow = openai.AsyncOpenAI(
        base_url=base_url, api_key=await _key(sessions, "narrow", "narrow"), max_retries=0
    )
    with pytest.raises(openai.PermissionDeniedError) as refused:
        await submit(narrow, chat_lines(engine_client.model_name, 2))
    assert "model_not_allowed" in str(refused.value.body)
    assert (await narrow.batches.list()).data == []


async def test_the_plans_cap_on_enqueued_batch_tokens_refuses_a_batch_past_it(
    base_url: str,
    engine_client: InProcessEngineClient,
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    async with sessions.begin() as session:
        terms = PlanTerms(name="capped", max_batch_tokens=200)
        await PlanService(session).create("capped", terms)
    capped = openai.AsyncOpenAI(
        base_url=base_url, api_key=await _key(sessions, "capped", "capped"), max_retries=0
    )
    first = await submit(
        capped, chat_lines(engine_client.model_name, 2)
    )  # 48 tokens a line at most
    with pytest.raises(openai.RateLimitError) as refused:
        await submit(capped, chat_lines(engine_client.model_name, 3))  # past 200 with the first
    assert "token_limit_exceeded" in str(refused.value.body)
    limit = refused.value.response.headers  # the cap that refused, and what is left of it
    assert limit["x-ratelimit-limit-tokens"] == "200"
    assert 0 <= int(limit["x-ratelimit-remaining-tokens"]) < 200
    await until(capped, first.id, "completed")
    await until(
        capped, (await submit(capped, chat_lines(engine_client.model_name, 2))).id, "completed"
    )


async def test_a_gateway_stopped_mid_batch_resumes_with_one_result_per_line(
    settings: Settings,
    engine_client: InProcessEngineClient,
    tenant_key: str,
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    total = 150
    async with serving(create_app(settings, engine_client=engine_client)) as url:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=tenant_key, max_retries=0)
        batch = await submit(client, chat_lines(engine_client.model_name, total, max_tokens=24))

        async def partly_done() -> bool:
            counts = (await client.batches.retrieve(batch.id)).request_counts
            return bool(counts.completed >= 3)

        await eventually(partly_done, timeout_s=120)
    stopped = (await _stored(sessions, batch.id)).completed
    assert stopped < total  # stopped mid-batch
    async with serving(create_app(settings, engine_client=engine_client)) as url:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=tenant_key, max_retries=0)
        done = await until(client, batch.id, "completed")
        output = await records(client, done.output_file_id)
    assert done.request_counts.completed == total and done.request_counts.failed == 0
    assert sorted(r["custom_id"] for r in output) == sorted(f"line-{i}" for i in range(total))
    async with sessions() as session:
        billed = await session.scalar(
            select(func.count()).where(
                UsageEvent.endpoint == "batch.chat.completions", UsageEvent.status == "completed"
            )
        )
    assert billed == total  # no line billed twice


async def _stored(sessions: async_sessionmaker[AsyncSession], batch_id: str) -> Batch:
    async with sessions() as session:
        batch = await session.get(Batch, batch_id)
        assert batch is not None
        return batch


async def test_lines_left_running_by_a_killed_gateway_run_again_unbilled(
    settings: Settings,
    engine_client: InProcessEngineClient,
    tenant_key: str,
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    """The worst moment to die: every line answered and billed, no result kept yet. The
    next gateway takes the lines back and runs them again; each line's key is in the
    ledger, so none is billed twice. A line keeps its result with itself: no line stores
    an Idempotency-Key record (one write and two reads a line, on the event loop)."""
    total = 8
    async with serving(create_app(settings, engine_client=engine_client)) as url:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=tenant_key, max_retries=0)
        batch = await submit(client, chat_lines(engine_client.model_name, total))
        first = await records(client, (await until(client, batch.id, "completed")).output_file_id)
    # As a gateway killed before keeping them, two minutes ago: its lease has lapsed.
    died = utcnow() - timedelta(minutes=2)
    async with sessions.begin() as session:
        await session.execute(
            update(BatchLine)
            .where(BatchLine.batch_id == batch.id)
            .values(status=LineStatus.RUNNING, claimed_at=died, result=None)
        )
        await session.execute(
            update(Batch)
            .where(Batch.id == batch.id)
            .values(status="in_progress", completed=0, output_file_id=None, completed_at=None)
        )
    async with serving(create_app(settings, engine_client=engine_client)) as url:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=tenant_key, max_retries=0)
        again = await records(client, (await until(client, batch.id, "completed")).output_file_id)
    assert sorted(r["custom_id"] for r in again) == sorted(r["custom_id"] for r in first)
    assert all(r["response"]["status_code"] == 200 for r in again)
    async with sessions() as session:
        billed = set((await session.scalars(select(UsageEvent.request_id))).all())
        stored = await session.scalar(select(func.count()).select_from(IdempotencyRecord))
    assert billed == {r["response"]["request_id"] for r in first}  # one row a line, the first
    assert billed.isdisjoint(r["response"]["request_id"] for r in again)  # the reruns: unbilled
    assert stored == 0


@contextlib.asynccontextmanager
async def _streaming_chat(
    url: str, engine_client: InProcessEngineClient, key: str
) -> AsyncIterator[None]:
    """A long chat streaming while the block runs: interactive work in the engine from the
    block's start (leaving the block aborts it)."""
    chat = {
        "model": engine_client.model_name,
        "messages": [{"role": "user", "content": "Talk."}],
        "max_tokens": 1900,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {key}"}
    async with (
        httpx.AsyncClient() as http,
        http.stream("POST", f"{url}/v1/chat/completions", json=chat, headers=headers),
    ):
        await eventually(lambda: engine_client.engine.engine.num_interactive() == 1)
        yield


async def test_lines_wait_for_interactive_work_to_drain_then_all_run(
    settings: Settings,
    engine_client: InProcessEngineClient,
    tenant_key: str,
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    """While an interactive request runs in the engine the runner starts no line (the
    engine would hold its rows, and its request path would slow the interactive one);
    once it is done, every line runs."""
    app = create_app(settings, engine_client=engine_client)
    async with serving(app) as url:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=tenant_key, max_retries=0)
        runner = app.state.batch_runner
        model = engine_client.model_name
        async with _streaming_chat(url, engine_client, tenant_key):
            cancelled = await submit(client, chat_lines(model, 3))
            await eventually(lambda: runner.held)  # a round looked, and started nothing
            await client.batches.cancel(cancelled.id)
            done = await until(client, cancelled.id, "cancelled")
            assert done.request_counts.completed == 0
            await eventually(lambda: not runner.held)  # nothing left to start: nothing held
            batch = await submit(client, chat_lines(model, 3))
            await eventually(lambda: runner.held)
            async with sessions() as session:
                statuses = await session.scalars(
                    select(BatchLine.status).where(BatchLine.batch_id == batch.id)
                )
                assert set(statuses) == {LineStatus.PENDING}
            assert engine_client.engine.engine.num_interactive() == 1  # still running
        # Leaving the stream aborts the chat: the lines start.
        done = await until(client, batch.id, "completed")
        assert (done.request_counts.completed, done.request_counts.failed) == (3, 0)
        assert not runner.held


async def test_a_batch_late_in_its_window_runs_beside_interactive_work(
    settings: Settings,
    engine_client: InProcessEngineClient,
    tenant_key: str,
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    """A steady trickle of chats would hold a batch's lines to its deadline: in the last
    half of its window a batch runs beside interactive work (its rows the engine's filler)
    and completes while the chat still streams."""
    app = create_app(settings, engine_client=engine_client)
    async with serving(app) as url:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=tenant_key, max_retries=0)
        runner = app.state.batch_runner
        model = engine_client.model_name
        async with _streaming_chat(url, engine_client, tenant_key):
            batch = await submit(client, chat_lines(model, 3))
            await eventually(lambda: runner.held)  # early in its window: it waits
            async with sessions.begin() as session:  # as if 13 of its 24 hours had passed
                await session.execute(
                    update(Batch)
                    .where(Batch.id == batch.id)
                    .values(expires_at=utcnow() + timedelta(hours=11))
                )
            done = await until(client, batch.id, "completed")
            assert (done.request_counts.completed, done.request_counts.failed) == (3, 0)
            assert engine_client.engine.engine.num_interactive() == 1  # the chat still runs


async def test_a_round_starts_its_lines_a_few_at_a_time_and_gives_back_the_rest(
    settings: Settings,
    engine_client: InProcessEngineClient,
    tenant_key: str,
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    """Lines start RAMP_LINES at a time: a chat that arrives after the first few finds
    only their request paths on the event loop; the lines claimed after it go back to
    pending, and run once it is done."""
    app = create_app(settings, engine_client=engine_client)
    async with serving(app) as url:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=tenant_key, max_retries=0)
        runner = app.state.batch_runner
        runner.concurrency = 10
        looks: list[int] = []
        chat = [0]  # the engine's interactive work, as the runner sees it

        def interactive() -> int:
            looks.append(chat[0])
            if len(looks) == 1:
                chat[0] = 1  # a chat arrives just after the round's first look
                return 0
            return chat[0]

        runner.interactive = interactive
        batch = await submit(client, chat_lines(engine_client.model_name, 10))

        async def counts() -> dict[str, int]:
            async with sessions() as session:
                statuses = list(
                    await session.scalars(
                        select(BatchLine.status).where(BatchLine.batch_id == batch.id)
                    )
                )
            return {status: statuses.count(status) for status in set(statuses)}

        async def started_ones_done() -> bool:
            return LineStatus.RUNNING not in await counts()

        await eventually(lambda: runner.held)
        await eventually(started_ones_done)
        assert await counts() == {LineStatus.SUCCEEDED: RAMP_LINES, LineStatus.PENDING: 6}
        chat[0] = 0  # the chat is done: the rest run
        done = await until(client, batch.id, "completed")
        assert (done.request_counts.completed, done.request_counts.failed) == (10, 0)
