"""Batches on /v1/completions and /v1/embeddings, a price book's own batch discount, and
the Files API's limits, with the official `openai` client against a real server
(in-process engine), on SQLite (embedded) and PostgreSQL (stack)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.dispatch.engine_client import InProcessEngineClient
from tenants import files
from tenants.models import KeyRole, UsageEvent
from tenants.pricing import DEFAULT_PRICE, Price
from tenants.services import ApiKeyService, TenantService
from tests.conftest import migrated_postgres, migrated_sqlite
from tests.support.batches import chat_lines, records, request_lines, submit, until

TEXTS = ["What does json.dumps do?", "Return the sum of a list.", "Name a prime.", "Why?"]


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Batches run on both: the embedded default and stack mode's database."""
    if request.param == "sqlite":
        return migrated_sqlite(tmp_path / "sdk.db")
    return migrated_postgres()


async def _events(sessions: async_sessionmaker[AsyncSession]) -> dict[str, UsageEvent]:
    """The ledger's rows by request id."""
    async with sessions() as session:
        return {e.request_id: e for e in await session.scalars(select(UsageEvent))}


async def _answered(client: openai.AsyncOpenAI, batch: Any, total: int) -> list[dict[str, Any]]:
    """The bodies of a batch's answers, line by line, once every line succeeded."""
    done = await until(client, batch.id, "completed", "failed")
    counts = (done.status, done.request_counts.completed, done.request_counts.failed)
    assert counts == ("completed", total, 0), await records(client, done.error_file_id)
    found = {r["custom_id"]: r for r in await records(client, done.output_file_id)}
    assert sorted(found) == sorted(f"line-{i}" for i in range(total))
    answers = [found[f"line-{i}"] for i in range(total)]
    assert all(r["error"] is None and r["response"]["status_code"] == 200 for r in answers)
    return answers


async def test_a_completions_batch_answers_every_line_billed_at_the_batch_price(
    client: openai.AsyncOpenAI,
    engine_client: InProcessEngineClient,
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    model, total = engine_client.model_name, 4
    bodies = [
        {"model": model, "prompt": text, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
        for text in TEXTS[:total]
    ]
    batch = await submit(
        client, request_lines("/v1/completions", bodies), endpoint="/v1/completions"
    )
    assert batch.endpoint == "/v1/completions" and batch.request_counts.total == total
    answers = await _answered(client, batch, total)
    events = await _events(sessions)
    assert len(events) == total
    for answer, text in zip(answers, TEXTS, strict=False):
        body = answer["response"]["body"]
        assert body["object"] == "text_completion" and body["model"] == model
        (choice,) = body["choices"]
        assert isinstance(choice["text"], str) and choice["finish_reason"] == "length"
        usage = body["usage"]
        assert usage["prompt_tokens"] == len(engine_client.encode(text))
        assert usage["completion_tokens"] == 3  # ignore_eos: all it asked for
        event = events[answer["response"]["request_id"]]  # one ledger row a line, its own
        assert event.endpoint == "batch.completions" and event.status == "completed"
        billed = (event.prompt_tokens, event.completion_tokens)
        assert billed == (usage["prompt_tokens"], usage["completion_tokens"])
        cost = DEFAULT_PRICE.for_batch().cost_micros(
            event.prompt_tokens, event.cached_tokens, event.completion_tokens
        )
        assert event.cost_micros == cost > 0


async def test_an_embeddings_batch_answers_every_line_with_a_vector_of_the_models_size(
    client: openai.AsyncOpenAI,
    engine_client: InProcessEngineClient,
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    model, size = engine_client.model_name, engine_client.hidden_size
    assert size is not None
    bodies = [{"model": model, "input": text} for text in TEXTS]
    batch = await submit(client, request_lines("/v1/embeddings", bodies), endpoint="/v1/embeddings")
    answers = await _answered(client, batch, len(TEXTS))
    events = await _events(sessions)
    assert len(events) == len(TEXTS)
    vectors = []
    for answer, text in zip(answers, TEXTS, strict=True):
        body = answer["response"]["body"]
        assert body["object"] == "list" and body["model"] == model
        (item,) = body["data"]
        assert item["object"] == "embedding" and item["index"] == 0
        assert len(item["embedding"]) == size
        assert all(isinstance(x, float) for x in item["embedding"])  # floats by default
        vectors.append(item["embedding"])
        tokens = len(engine_client.encode(text))
        assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
        event = events[answer["response"]["request_id"]]
        assert event.endpoint == "batch.embeddings" and event.status == "completed"
        assert (event.prompt_tokens, event.completion_tokens) == (tokens, 0)
        assert event.cost_micros == DEFAULT_PRICE.for_batch().cost_micros(tokens, 0, 0) > 0
    assert len({tuple(v) for v in vectors}) == len(TEXTS)  # each text its own vector


async def test_a_models_own_batch_discount_prices_its_lines(
    client: openai.AsyncOpenAI,
    base_url: str,
    engine_client: InProcessEngineClient,
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    """A price version with a 20% batch discount, not the default 50%: each line costs 80%
    of its tokens' full price (integer rates: 1 and 4 micros a token, 0.8 and 3.2 off)."""
    model = engine_client.model_name
    async with sessions.begin() as session:
        ops = await TenantService(session).create("ops")
        admin = (await ApiKeyService(session).create(ops, "root", KeyRole.ADMIN)).secret
    full = Price(1_000_000, 500_000, 4_000_000, batch_discount_pct=20)
    async with httpx.AsyncClient() as http:
        created = await http.post(
            base_url.removesuffix("/v1") + "/admin/api/prices",
            headers={"Authorization": f"Bearer {admin}"},
            json={
                "model": model,
                "input_micros_per_mtok": full.input_micros_per_mtok,
                "cached_input_micros_per_mtok": full.cached_input_micros_per_mtok,
                "output_micros_per_mtok": full.output_micros_per_mtok,
                "batch_discount_pct": 20,
            },
        )
    assert created.status_code == 201, created.text
    version_id = created.json()["id"]
    batch = await submit(client, chat_lines(model, 3, max_tokens=6))
    answers = await _answered(client, batch, 3)
    events = await _events(sessions)
    assert len(events) == 3
    batch_price = full.for_batch()
    assert batch_price == Price(800_000, 400_000, 3_200_000, batch_discount_pct=20)
    for answer in answers:
        event = events[answer["response"]["request_id"]]
        assert event.endpoint == "batch.chat.completions"
        assert event.price_version_id == version_id
        tokens = (event.prompt_tokens, event.cached_tokens, event.completion_tokens)
        full_cost = full.cost_micros(*tokens)
        assert event.cost_micros == batch_price.cost_micros(*tokens) == -(-full_cost * 8 // 10)
        half = Price(1_000_000, 500_000, 4_000_000).for_batch().cost_micros(*tokens)
        assert half < event.cost_micros < full_cost  # not the default discount, nor none


async def test_a_file_past_the_line_limit_is_refused(
    client: openai.AsyncOpenAI,
    engine_client: InProcessEngineClient,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(files, "MAX_LINES", 3)
    model = engine_client.model_name
    at_limit = await client.files.create(
        file=("three.jsonl", chat_lines(model, 3)), purpose="batch"
    )
    assert at_limit.bytes == len(chat_lines(model, 3))
    with pytest.raises(openai.BadRequestError) as refused:
        await client.files.create(file=("four.jsonl", chat_lines(model, 4)), purpose="batch")
    assert "at most 3 requests" in str(refused.value.body)
    assert [f.id for f in (await client.files.list()).data] == [at_limit.id]


async def test_a_file_past_the_size_limit_is_refused(
    client: openai.AsyncOpenAI,
    engine_client: InProcessEngineClient,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    content = chat_lines(engine_client.model_name, 2)
    monkeypatch.setattr(files, "MAX_FILE_BYTES", len(content))
    at_limit = await client.files.create(file=("fits.jsonl", content), purpose="batch")
    with pytest.raises(openai.BadRequestError) as refused:
        await client.files.create(file=("big.jsonl", content + b"\n"), purpose="batch")
    assert f"at most {len(content)} bytes" in str(refused.value.body)
    assert [f.id for f in (await client.files.list()).data] == [at_limit.id]
