"""The official `openai` client, sync and async, against a real server: the API works as
the SDK expects, errors included."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from gateway.app import create_app
from gateway.dispatch.engine_client import InProcessEngineClient
from gateway.settings import Settings
from tests.conftest import eventually, migrated_sqlite, serving

MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "What does json.dumps do?"}
]


@pytest.fixture
def database_url(tmp_path: Path) -> str:
    """SQLite only: these tests are about the API, the ledger is tested on both."""
    return migrated_sqlite(tmp_path / "compat.db")


@pytest.fixture
async def base_url(settings: Settings, engine_client: InProcessEngineClient) -> AsyncIterator[str]:
    async with serving(create_app(settings, engine_client=engine_client)) as url:
        yield url + "/v1"


@pytest.fixture
def clients(base_url: str, tenant_key: str) -> tuple[openai.OpenAI, openai.AsyncOpenAI]:
    return (
        openai.OpenAI(base_url=base_url, api_key=tenant_key, max_retries=0),
        openai.AsyncOpenAI(base_url=base_url, api_key=tenant_key, max_retries=0),
    )


async def test_chat_sync_and_async_agree(
    clients: tuple[openai.OpenAI, openai.AsyncOpenAI], engine_client: InProcessEngineClient
) -> None:
    sync, async_ = clients
    model = engine_client.model_name
    args: dict[str, Any] = {
        "model": model,
        "messages": MESSAGES,
        "max_tokens": 10,
        "temperature": 0,
    }
    first = await asyncio.to_thread(lambda: sync.chat.completions.create(**args))
    second = await async_.chat.completions.create(**args)
    assert first.choices[0].message.content == second.choices[0].message.content
    assert first.choices[0].message.role == "assistant"
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens is not None


async def test_streaming_with_include_usage(
    clients: tuple[openai.OpenAI, openai.AsyncOpenAI], engine_client: InProcessEngineClient
) -> None:
    _, client = clients
    stream = await client.chat.completions.create(
        model=engine_client.model_name,
        messages=MESSAGES,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert all(chunk.usage is None for chunk in chunks[:-1])
    assert 0 < chunks[-1].usage.completion_tokens <= 10
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")


async def test_completions_echo_and_stream(
    clients: tuple[openai.OpenAI, openai.AsyncOpenAI], engine_client: InProcessEngineClient
) -> None:
    _, client = clients
    model = engine_client.model_name
    plain = await client.completions.create(
        model=model, prompt="Return the", max_tokens=6, temperature=0
    )
    echoed = await client.completions.create(
        model=model, prompt="Return the", max_tokens=6, temperature=0, echo=True
    )
    assert echoed.choices[0].text == "Return the" + plain.choices[0].text
    stream = await client.completions.create(
        model=model, prompt="Return the", max_tokens=6, temperature=0, echo=True, stream=True
    )
    assert "".join([c.choices[0].text async for c in stream]) == echoed.choices[0].text


def _completion(model: str, max_tokens: int, temperature: float = 0) -> dict[str, Any]:
    """Arguments of a completion that runs to max_tokens unless something stops it."""
    return {
        "model": model,
        "prompt": "Return the" if temperature == 0 else "The",
        "max_tokens": max_tokens,
        "temperature": temperature,
        "extra_body": {"ignore_eos": True},
    }


async def test_stop_strings_cut_the_output(
    clients: tuple[openai.OpenAI, openai.AsyncOpenAI], engine_client: InProcessEngineClient
) -> None:
    _, client = clients
    args = _completion(engine_client.model_name, 24)
    full = (await client.completions.create(**args)).choices[0].text
    stop = full[len(full) // 2 :][:3]
    assert stop.strip(), full
    cut = await client.completions.create(**args, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == full[: full.index(stop)]


async def test_vllm_sampling_extras(
    clients: tuple[openai.OpenAI, openai.AsyncOpenAI], engine_client: InProcessEngineClient
) -> None:
    """min_tokens defers a stop string; the penalties change a greedy answer."""
    _, client = clients
    args = _completion(engine_client.model_name, 12)
    plain = (await client.completions.create(**args)).choices[0]
    stop = plain.text.strip()[:1]
    early = await client.completions.create(**args, stop=[stop])
    args["extra_body"]["min_tokens"] = 8
    late = await client.completions.create(**args, stop=[stop])
    assert early.usage and late.usage
    assert early.usage.completion_tokens < 8 <= late.usage.completion_tokens
    args["extra_body"] = {"ignore_eos": True, "repetition_penalty": 2.0}
    penalised = await client.completions.create(**args, frequency_penalty=2.0, presence_penalty=1.0)
    assert penalised.choices[0].text != plain.text


async def test_seed_reproduces_a_sampled_answer(
    clients: tuple[openai.OpenAI, openai.AsyncOpenAI], engine_client: InProcessEngineClient
) -> None:
    _, client = clients
    args = _completion(engine_client.model_name, 16, temperature=1.0)
    texts = [(await client.completions.create(**args, seed=s)).choices[0].text for s in (7, 7, 8)]
    assert texts[0] == texts[1]
    assert texts[0] != texts[2]  # 16 sampled tokens: a collision would be a broken sampler


async def test_request_id_header(
    clients: tuple[openai.OpenAI, openai.AsyncOpenAI], engine_client: InProcessEngineClient
) -> None:
    _, client = clients
    raw = await client.completions.with_raw_response.create(
        model=engine_client.model_name, prompt="The", max_tokens=2
    )
    assert raw.headers["x-request-id"].startswith("req_")
    assert raw.parse().id == "cmpl-" + raw.headers["x-request-id"].removeprefix("req_")


async def test_each_error_has_its_exception_class(
    clients: tuple[openai.OpenAI, openai.AsyncOpenAI],
    base_url: str,
    engine_client: InProcessEngineClient,
) -> None:
    _, client = clients
    model = engine_client.model_name
    stranger = openai.AsyncOpenAI(base_url=base_url, api_key="tg-nobody", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await stranger.models.list()
    with pytest.raises(openai.BadRequestError) as bad:
        await client.chat.completions.create(model=model, messages=[])
    assert bad.value.status_code == 400
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError) as too_long:
        await client.completions.create(model=model, prompt=[1] * engine_client.max_model_len)
    assert too_long.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        await client.completions.create(model=model, prompt="x", temperature=7)


# litellm's exception_mapping_utils (ExceptionCheckers.is_error_str_context_window_exceeded)
# maps a 400 to ContextWindowExceededError, which its context_window_fallbacks act on,
# only when the lowered error text holds one of these; OpenAI's and vLLM's hold the first.
LITELLM_CONTEXT_WINDOW = ("this model's maximum context length is", "exceed context limit")


def message(error: openai.BadRequestError) -> str:
    """The error's own message (the SDK's `.message` adds "Error code: 400 - ")."""
    assert isinstance(error.body, dict)
    return str(error.body["message"])


def litellm_sees_context_overflow(error: openai.BadRequestError) -> bool:
    text = str(error).lower()
    return not re.search(r"rate[\s_\-]*limit", text) and any(
        known in text for known in LITELLM_CONTEXT_WINDOW
    )


async def test_context_overflow_reads_as_openais_and_vllms(
    clients: tuple[openai.OpenAI, openai.AsyncOpenAI], engine_client: InProcessEngineClient
) -> None:
    """A prompt and max_tokens past the context, a prompt past it alone, and a prompt too
    long to tokenize: each a 400 context_length_exceeded in OpenAI's and vLLM's words,
    which litellm recognises."""
    _, client = clients
    model, context = engine_client.model_name, engine_client.max_model_len
    prompt = len(engine_client.encode("Once upon a time"))
    too_many = context - prompt + 1
    with pytest.raises(openai.BadRequestError) as both:
        await client.completions.create(model=model, prompt="Once upon a time", max_tokens=too_many)
    assert both.value.code == "context_length_exceeded"
    assert message(both.value) == (
        f"This model's maximum context length is {context} tokens. However, you requested "
        f"{context + 1} tokens ({prompt} in the messages, {too_many} in the completion). "
        "Please reduce the length of the messages or completion."
    )
    with pytest.raises(openai.BadRequestError) as prompt_alone:
        await client.completions.create(model=model, prompt=[1] * (context + 5))
    assert message(prompt_alone.value) == (
        f"This model's maximum context length is {context} tokens. However, your prompt "
        f"resulted in {context + 5} tokens. Please reduce the length of the prompt."
    )
    huge = "x" * (context * engine_client.max_token_chars + 1)
    with pytest.raises(openai.BadRequestError) as untokenized:
        await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": huge}]
        )
    assert message(untokenized.value).startswith(
        f"This model's maximum context length is {context} tokens. However, you sent"
    )
    for refused in (both.value, prompt_alone.value, untokenized.value):
        assert refused.code == "context_length_exceeded"
        assert litellm_sees_context_overflow(refused), message(refused)


async def test_server_timeout_is_504_and_aborts(
    settings: Settings, engine_client: InProcessEngineClient, tenant_key: str
) -> None:
    app = create_app(replace(settings, request_timeout_s=0.05), engine_client=engine_client)
    async with serving(app) as url:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=tenant_key, max_retries=0)
        with pytest.raises(openai.InternalServerError) as info:
            await client.completions.create(
                model=engine_client.model_name,
                prompt="The",
                max_tokens=1000,  # cannot finish in 50 ms, even on a fast machine
                extra_body={"ignore_eos": True},
            )
    assert info.value.status_code == 504

    def aborted() -> bool:  # at the engine's next step boundary
        stats = engine_client.engine.stats()
        return stats.num_running == 0 and stats.kv_blocks_used == 0

    await eventually(aborted)


async def test_n_choices_sync_and_streamed(
    clients: tuple[openai.OpenAI, openai.AsyncOpenAI], engine_client: InProcessEngineClient
) -> None:
    sync, client = clients
    args: dict[str, Any] = {
        "model": engine_client.model_name,
        "messages": MESSAGES,
        "max_tokens": 8,
        "temperature": 1.0,
        "seed": 11,
        "n": 2,
    }
    whole = await asyncio.to_thread(lambda: sync.chat.completions.create(**args))
    assert [c.index for c in whole.choices] == [0, 1]
    assert whole.usage is not None
    stream = await client.chat.completions.create(**args, stream=True)
    texts = {0: "", 1: ""}
    finished = set()
    async for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1}
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]  # seeded
    single = await client.chat.completions.create(**{**args, "n": 1})
    assert single.choices[0].message.content == texts[0]  # choice 0 draws with the seed


async def test_logprobs_chat_and_completions(
    clients: tuple[openai.OpenAI, openai.AsyncOpenAI], engine_client: InProcessEngineClient
) -> None:
    _, client = clients
    model = engine_client.model_name
    chat = await client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == chat.usage.completion_tokens  # type: ignore[union-attr]
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob <= 0
        # Greedy: the chosen token is the most likely one.
        assert entry.logprob == pytest.approx(max(t.logprob for t in entry.top_logprobs))
    text = await client.completions.create(
        model=model, prompt="Return the", max_tokens=5, temperature=0, logprobs=2
    )
    logprobs = text.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert text.usage is not None
    assert (
        len(logprobs.tokens) == len(logprobs.token_logprobs or []) == text.usage.completion_tokens
    )
    assert all(len(top) <= 2 for top in logprobs.top_logprobs or [])
    plain = await client.completions.create(model=model, prompt="Return the", max_tokens=5)
    assert plain.choices[0].logprobs is None


async def test_plan_and_quota_errors_have_their_exception_classes(
    base_url: str, sessions: Any, engine_client: InProcessEngineClient
) -> None:
    from tenants.limits import LimitSet, PlanTerms
    from tenants.services import ApiKeyService, PlanService, TenantService

    async with sessions.begin() as session:
        terms = PlanTerms(limits=LimitSet(rpm=1), max_priority=2)
        await PlanService(session).create("tight", terms)
        await TenantService(session).create("tightco")
        tenant = await TenantService(session).set_plan("tightco", "tight")
        key = (await ApiKeyService(session).create(tenant)).secret
    client = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0)
    model = engine_client.model_name
    with pytest.raises(openai.PermissionDeniedError):
        await client.completions.create(
            model=model, prompt="x", max_tokens=1, extra_body={"priority": 0}
        )
    await client.completions.create(model=model, prompt="x", max_tokens=1)
    with pytest.raises(openai.RateLimitError) as limited:
        await client.completions.create(model=model, prompt="x", max_tokens=1)
    assert limited.value.response.headers["retry-after"]
    assert limited.value.code == "rate_limit_exceeded"
