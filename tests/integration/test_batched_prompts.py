"""Batched prompts on /v1/completions, through the openai SDK: a list of prompts is one
request (one ledger row, one reservation for all of it) whose choices are numbered as
OpenAI numbers them, prompt i's completion j at index i * n + j."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from langchain_openai import OpenAI
from pydantic import SecretStr
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.api.schemas import MAX_PROMPTS
from gateway.app import create_app
from gateway.dispatch.engine_client import InProcessEngineClient
from gateway.settings import Settings
from tenants.limits import LimitSet
from tenants.models import UsageEvent
from tests.conftest import eventually, serving
from tests.integration.test_openai_compat import database_url  # noqa: F401 (a fixture)
from tests.integration.test_quotas import _tenant_key

Sessions = async_sessionmaker[AsyncSession]
PROMPTS = ["Return the", "def add(a, b):", "import json"]


@pytest.fixture
async def base_url(settings: Settings, engine_client: InProcessEngineClient) -> AsyncIterator[str]:
    async with serving(create_app(settings, engine_client=engine_client)) as url:
        yield url


@pytest.fixture
def client(base_url: str, tenant_key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=tenant_key, max_retries=0)


async def _rows(sessions: Sessions) -> list[UsageEvent]:
    async with sessions() as session:
        return list((await session.execute(select(UsageEvent))).scalars())


def _args(model: str, **extra: Any) -> dict[str, Any]:
    body = {"ignore_eos": True, **extra}
    return {"model": model, "max_tokens": 6, "temperature": 0, "extra_body": body}


async def _alone(client: openai.AsyncOpenAI, model: str, prompt: str) -> tuple[str, int]:
    """The text and prompt tokens of `prompt` sent on its own."""
    answer = await client.completions.create(prompt=prompt, **_args(model))
    assert answer.usage is not None
    return answer.choices[0].text, answer.usage.prompt_tokens


async def test_a_list_of_prompts_is_one_request_with_choices_by_prompt(
    client: openai.AsyncOpenAI, engine_client: InProcessEngineClient, sessions: Sessions
) -> None:
    model = engine_client.model_name
    alone = [await _alone(client, model, prompt) for prompt in PROMPTS]
    batch = await client.completions.create(prompt=PROMPTS, n=2, **_args(model))
    assert [c.index for c in batch.choices] == list(range(2 * len(PROMPTS)))
    for choice in batch.choices:  # greedy: both completions of a prompt are its lone answer
        assert choice.text == alone[choice.index // 2][0]
    assert batch.usage is not None
    assert batch.usage.prompt_tokens == sum(tokens for _, tokens in alone)
    assert batch.usage.completion_tokens == 6 * 2 * len(PROMPTS)
    await eventually(lambda: _rows(sessions))
    rows = await _rows(sessions)
    assert len(rows) == len(PROMPTS) + 1  # the lone ones, then one for the whole batch
    assert rows[-1].completion_tokens == 6 * 2 * len(PROMPTS)


async def test_token_id_batches_stream_and_echo(
    client: openai.AsyncOpenAI, engine_client: InProcessEngineClient
) -> None:
    model = engine_client.model_name
    ids = [engine_client.encode(prompt) for prompt in PROMPTS]
    whole = await client.completions.create(prompt=ids, **_args(model, echo=True))
    stream = await client.completions.create(
        prompt=ids,
        stream=True,
        stream_options={"include_usage": True},
        **_args(model, echo=True),
    )
    texts = dict.fromkeys(range(len(PROMPTS)), "")
    usage = None
    async for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
        usage = chunk.usage or usage
    assert [texts[i] for i in range(len(PROMPTS))] == [c.text for c in whole.choices]
    for prompt, choice in zip(PROMPTS, whole.choices, strict=True):
        assert choice.text.startswith(engine_client.decode(engine_client.encode(prompt)))
    assert usage is not None and whole.usage is not None
    assert usage.prompt_tokens == whole.usage.prompt_tokens == sum(len(p) for p in ids)


async def test_the_reservation_covers_every_prompt(
    base_url: str, engine_client: InProcessEngineClient, sessions: Sessions
) -> None:
    """Worst case: every prompt's tokens plus max_tokens for each of its n completions."""
    model = engine_client.model_name
    prompt_tokens = sum(len(engine_client.encode(p)) for p in PROMPTS)
    worst = prompt_tokens + 6 * 2 * len(PROMPTS)
    _, key = await _tenant_key(sessions, LimitSet(tpm=worst - 1))
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=key, max_retries=0)
    alone = await client.completions.create(prompt=PROMPTS[0], n=2, **_args(model))
    assert alone.choices
    with pytest.raises(openai.RateLimitError):
        await client.completions.create(prompt=PROMPTS, n=2, **_args(model))


@pytest.mark.parametrize(
    ("prompt", "code"),
    [
        (["a"] * (MAX_PROMPTS + 1), "too_many_prompts"),
        (["a", [1, 2]], None),
        ([[1, 2], []], None),
    ],
    ids=["too-many", "mixed", "one-empty"],
)
async def test_bad_batches_are_refused_naming_the_prompt(
    client: openai.AsyncOpenAI, engine_client: InProcessEngineClient, prompt: Any, code: str | None
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        await client.completions.create(prompt=prompt, **_args(engine_client.model_name))
    error = refused.value.body
    assert isinstance(error, dict)
    assert error["param"] == "prompt"
    if code is not None:
        assert error["code"] == code


async def test_a_prompt_past_the_context_is_context_length_exceeded(
    client: openai.AsyncOpenAI, engine_client: InProcessEngineClient
) -> None:
    too_many_ids = [[1, 2], [0] * engine_client.max_model_len]
    too_many_chars = [
        "short",
        "x" * (engine_client.max_model_len * engine_client.max_token_chars + 1),
    ]
    for prompt in (too_many_ids, too_many_chars):
        with pytest.raises(openai.BadRequestError) as refused:
            await client.completions.create(prompt=prompt, **_args(engine_client.model_name))
        error = refused.value.body
        assert isinstance(error, dict)
        assert (error["code"], error["param"]) == ("context_length_exceeded", "prompt")


async def test_leaving_a_batch_aborts_every_prompt(
    base_url: str, tenant_key: str, engine_client: InProcessEngineClient, sessions: Sessions
) -> None:
    body = {
        "model": engine_client.model_name,
        "max_tokens": 1000,
        "ignore_eos": True,
        "prompt": PROMPTS,
        "stream": True,
    }
    async with (
        httpx.AsyncClient(base_url=base_url) as http,
        http.stream(
            "POST",
            "/v1/completions",
            json=body,
            headers={"Authorization": f"Bearer {tenant_key}"},
        ) as response,
    ):
        seen: set[int] = set()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                seen.update(c["index"] for c in json.loads(line[6:])["choices"] if c["text"])
            if len(seen) == len(PROMPTS) and engine_client.engine.stats().num_running:
                break  # every prompt is generating: leave mid-stream
    stats = engine_client.engine.stats
    await eventually(lambda: stats().num_running == 0 and stats().num_waiting == 0)
    await eventually(lambda: _rows(sessions))
    [row] = await _rows(sessions)
    assert row.status == "cancelled"
    assert row.completion_tokens < 1000 * len(PROMPTS)


async def test_langchains_openai_class_sends_a_batch(
    base_url: str,
    tenant_key: str,
    client: openai.AsyncOpenAI,
    engine_client: InProcessEngineClient,
    sessions: Sessions,
) -> None:
    """LangChain's plain (completions) `OpenAI` sends its prompts as one list."""
    model = engine_client.model_name
    llm = OpenAI(
        base_url=base_url + "/v1",
        api_key=SecretStr(tenant_key),
        model=model,
        max_tokens=6,
        temperature=0,
        max_retries=0,
        extra_body={"ignore_eos": True},
    )
    result = await llm.agenerate(PROMPTS)
    await eventually(lambda: _rows(sessions))
    assert len(await _rows(sessions)) == 1  # one request for the three
    alone = [await _alone(client, model, prompt) for prompt in PROMPTS]
    assert [g[0].text for g in result.generations] == [text for text, _ in alone]
