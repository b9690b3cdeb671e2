"""The gateway app on SQLite and on PostgreSQL, with the real engine on the built-in model."""

from __future__ import annotations

import json
from typing import Any

import pytest
from litestar.testing import AsyncTestClient
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from backend.sampling import SamplingParams
from gateway.dispatch.engine_client import GenerateRequest, InProcessEngineClient
from tenants.models import UsageEvent, UsageStatus
from tenants.services import ApiKeyService
from tests.conftest import eventually

Client = AsyncTestClient[Any]
Sessions = async_sessionmaker[AsyncSession]


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _chat(model: str, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": "What does json.dumps do?"}]
    return {"model": model, "messages": messages, "max_tokens": 12, "temperature": 0, **extra}


async def _ledger(sessions: Sessions) -> list[UsageEvent]:
    async with sessions() as session:
        return list((await session.execute(select(UsageEvent))).scalars())


def _sse_events(body: str) -> list[str]:
    return [line.removeprefix("data: ") for line in body.split("\n\n") if line.startswith("data: ")]


async def test_chat_completion_is_metered(
    client: Client, tenant_key: str, sessions: Sessions, engine_client: InProcessEngineClient
) -> None:
    response = await client.post(
        "/v1/chat/completions", json=_chat(engine_client.model_name), headers=_auth(tenant_key)
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["choices"][0]["message"]["content"]
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    assert usage["completion_tokens"] <= 12
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    request_id = response.headers["x-request-id"]

    [row] = await _ledger(sessions)
    assert row.request_id == request_id
    assert row.status == "completed"
    assert (row.prompt_tokens, row.completion_tokens) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )
    assert row.cost_micros > 0
    assert row.e2e_ms is not None and row.ttft_ms is not None
    assert row.ttft_ms <= row.e2e_ms


async def test_greedy_chat_is_deterministic(
    client: Client, tenant_key: str, engine_client: InProcessEngineClient
) -> None:
    payload = _chat(engine_client.model_name)
    first = await client.post("/v1/chat/completions", json=payload, headers=_auth(tenant_key))
    second = await client.post("/v1/chat/completions", json=payload, headers=_auth(tenant_key))
    text = first.json()["choices"][0]["message"]["content"]
    assert text == second.json()["choices"][0]["message"]["content"]


async def test_streamed_chat_matches_the_whole_response(
    client: Client, tenant_key: str, sessions: Sessions, engine_client: InProcessEngineClient
) -> None:
    payload = _chat(engine_client.model_name)
    whole = await client.post("/v1/chat/completions", json=payload, headers=_auth(tenant_key))
    streamed = await client.post(
        "/v1/chat/completions",
        json={**payload, "stream": True, "stream_options": {"include_usage": True}},
        headers=_auth(tenant_key),
    )
    assert streamed.status_code == 200
    assert streamed.headers["content-type"].startswith("text/event-stream")
    events = _sse_events(streamed.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == whole.json()["choices"][0]["message"]["content"]
    assert chunks[-2]["choices"][0]["finish_reason"] in ("stop", "length")
    assert chunks[-1]["choices"] == []
    streamed_usage, whole_usage = chunks[-1]["usage"], whole.json()["usage"]
    for field in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert streamed_usage[field] == whole_usage[field]  # cached_tokens may differ: a hit
    assert all(c["usage"] is None for c in chunks[:-1])
    rows = await _ledger(sessions)
    assert len(rows) == 2
    assert {r.completion_tokens for r in rows} == {whole.json()["usage"]["completion_tokens"]}


async def test_text_completion_with_text_and_token_ids(
    client: Client, tenant_key: str, engine_client: InProcessEngineClient
) -> None:
    base = {"model": engine_client.model_name, "max_tokens": 8, "temperature": 0}
    as_text = await client.post(
        "/v1/completions", json={**base, "prompt": "Return the"}, headers=_auth(tenant_key)
    )
    assert as_text.status_code == 200, as_text.text
    ids = engine_client.encode("Return the")
    as_ids = await client.post(
        "/v1/completions", json={**base, "prompt": ids}, headers=_auth(tenant_key)
    )
    assert as_text.json()["object"] == "text_completion"
    assert as_text.json()["choices"][0]["text"] == as_ids.json()["choices"][0]["text"]
    assert as_ids.json()["usage"]["prompt_tokens"] == len(ids)


async def test_models_lists_the_engine_model(
    client: Client, tenant_key: str, engine_client: InProcessEngineClient
) -> None:
    response = await client.get("/v1/models", headers=_auth(tenant_key))
    assert response.status_code == 200
    assert [m["id"] for m in response.json()["data"]] == [engine_client.model_name]


async def _assert_error(response: Any, status: int, param: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    return dict(error)


@pytest.mark.parametrize(
    "header",
    [None, "Bearer nonsense", "Bearer tg-AAAAAAAA_" + "x" * 43, "Basic Zm9vOmJhcg=="],
)
async def test_bad_keys_get_401_and_no_ledger_row(
    client: Client, sessions: Sessions, header: str | None, engine_client: InProcessEngineClient
) -> None:
    headers = {"Authorization": header} if header else {}
    response = await client.post(
        "/v1/chat/completions", json=_chat(engine_client.model_name), headers=headers
    )
    error = await _assert_error(response, 401)
    assert error["type"] == "authentication_error"
    assert await _ledger(sessions) == []


async def test_revoked_key_gets_401(
    client: Client, tenant_key: str, sessions: Sessions, engine_client: InProcessEngineClient
) -> None:
    async with sessions.begin() as session:
        await ApiKeyService(session).revoke(tenant_key.split("_")[0])
    response = await client.post(
        "/v1/chat/completions", json=_chat(engine_client.model_name), headers=_auth(tenant_key)
    )
    await _assert_error(response, 401)
    assert await _ledger(sessions) == []


async def test_invalid_bodies_get_400_naming_the_field(
    client: Client, tenant_key: str, sessions: Sessions, engine_client: InProcessEngineClient
) -> None:
    model = engine_client.model_name
    url, headers = "/v1/chat/completions", _auth(tenant_key)
    missing = await client.post(url, json={"model": model}, headers=headers)
    error = await _assert_error(missing, 400, "messages")
    assert error["type"] == "invalid_request_error"
    malformed = await client.post(url, content=b'{"model": ', headers=headers)
    await _assert_error(malformed, 400)
    out_of_range = await client.post(url, json=_chat(model, temperature=5), headers=headers)
    await _assert_error(out_of_range, 400, "temperature")
    unknown_model = await client.post(url, json=_chat("no-such-model"), headers=headers)
    assert (await _assert_error(unknown_model, 404, "model"))["code"] == "model_not_found"
    too_long = await client.post(url, json=_chat(model, max_tokens=10**6), headers=headers)
    await _assert_error(too_long, 400, "max_tokens")
    min_above_max = _chat(model, max_tokens=2, min_tokens=3)
    await _assert_error(
        await client.post(url, json=min_above_max, headers=headers), 400, "min_tokens"
    )
    no_penalty = _chat(model, repetition_penalty=0)
    await _assert_error(
        await client.post(url, json=no_penalty, headers=headers), 400, "repetition_penalty"
    )
    assert await _ledger(sessions) == []


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"seed": 1180591620717411303424}, "seed"),
        ({"seed": 18446744073709551615, "n": 2}, "seed"),
        ({"seed": 2**63 - 1, "n": 2}, "seed"),  # choice 1 would draw with 2^63
        ({"seed": -1}, "seed"),
        ({"top_k": 2**70}, "top_k"),
        ({"max_tokens": 2**70}, "max_tokens"),
        ({"min_tokens": 2**64}, "min_tokens"),
        ({"ttft_deadline_ms": 10**30}, "ttft_deadline_ms"),
        ({"repetition_penalty": 1e300}, "repetition_penalty"),
        ({"stop": "x" * 2000}, "stop"),
    ],
)
async def test_unbounded_numbers_get_400_and_the_engine_keeps_serving(
    client: Client,
    tenant_key: str,
    engine_client: InProcessEngineClient,
    extra: dict[str, Any],
    param: str,
) -> None:
    model, headers = engine_client.model_name, _auth(tenant_key)
    poison = await client.post("/v1/chat/completions", json=_chat(model, **extra), headers=headers)
    await _assert_error(poison, 400, param)
    normal = await client.post("/v1/chat/completions", json=_chat(model, seed=7), headers=headers)
    assert normal.status_code == 200, normal.text
    assert engine_client.is_alive() and engine_client.is_ready()


async def test_a_prompt_the_engine_refuses_is_a_400_naming_the_prompt(
    client: Client, tenant_key: str, sessions: Sessions, engine_client: InProcessEngineClient
) -> None:
    """The engine's own refusal (a token id past the vocabulary) travels as a typed error
    with its parameter, not as a ValueError whose message is parsed."""
    body = {"model": engine_client.model_name, "prompt": [10**6], "max_tokens": 2}
    response = await client.post("/v1/completions", json=body, headers=_auth(tenant_key))
    error = await _assert_error(response, 400, "prompt")
    assert "token ids" in error["message"]
    await _eventually_one_row(sessions, status=UsageStatus.FAILED, error="invalid_request_error")


async def test_a_stray_value_error_in_the_engine_is_a_500_not_the_clients_400(
    client: Client,
    tenant_key: str,
    sessions: Sessions,
    engine_client: InProcessEngineClient,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Only InvalidParameterError means "your request": a ValueError from a defect is
    ours, and its text (which may hold request data) is not sent back."""

    def defect(*_: Any) -> None:
        raise ValueError("temperature is off somewhere inside")

    monkeypatch.setattr(engine_client.engine.engine, "add_request", defect)
    response = await client.post(
        "/v1/chat/completions", json=_chat(engine_client.model_name), headers=_auth(tenant_key)
    )
    error = await _assert_error(response, 500)
    assert error["code"] == "internal_error" and "temperature" not in error["message"]
    await _eventually_one_row(sessions, status=UsageStatus.FAILED, error="internal_error")


async def _eventually_one_row(sessions: Sessions, **expected: Any) -> None:
    """A failed request's row is written after its answer (by a tracked task)."""

    async def one_row() -> bool:
        rows = await _ledger(sessions)
        return len(rows) == 1 and all(getattr(rows[0], k) == v for k, v in expected.items())

    await eventually(one_row)


async def test_the_largest_valid_seeds_are_served(
    client: Client, tenant_key: str, engine_client: InProcessEngineClient
) -> None:
    body = _chat(engine_client.model_name, seed=2**63 - 2, n=2, temperature=1.0)
    response = await client.post("/v1/chat/completions", json=body, headers=_auth(tenant_key))
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 2


async def test_prompt_longer_than_the_context_gets_400_context_length_exceeded(
    client: Client, tenant_key: str, engine_client: InProcessEngineClient
) -> None:
    prompt = [5] * (engine_client.max_model_len + 1)
    response = await client.post(
        "/v1/completions",
        json={"model": engine_client.model_name, "prompt": prompt},
        headers=_auth(tenant_key),
    )
    assert (await _assert_error(response, 400, "prompt"))["code"] == "context_length_exceeded"


async def test_probes(client: Client) -> None:
    assert (await client.get("/healthz")).json() == {"status": "ok"}
    ready = await client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json()["checks"] == {"database": True, "engine": True}


async def test_unknown_route_is_404_in_openai_shape(client: Client) -> None:
    response = await client.get("/v1/nothing")
    await _assert_error(response, 404)


async def test_ledger_counts_one_row_per_finished_request(
    client: Client, tenant_key: str, sessions: Sessions, engine_client: InProcessEngineClient
) -> None:
    payload = _chat(engine_client.model_name, max_tokens=4)
    for _ in range(3):
        response = await client.post(
            "/v1/chat/completions", json=payload, headers=_auth(tenant_key)
        )
        assert response.status_code == 200
    async with sessions() as session:
        count = await session.scalar(select(func.count()).select_from(UsageEvent))
    assert count == 3


async def test_a_dead_engine_fails_the_liveness_probe(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Liveness follows the in-process engine: once its step loop has died for good, a
    supervisor must restart the process instead of every tenant getting 503s."""
    from backend.builtin import BUILTIN_MODEL_DIR
    from backend.engine.engine import MAX_FAILED_STEPS
    from gateway.app import create_app, engine_config

    engine_client = await InProcessEngineClient.load(BUILTIN_MODEL_DIR, engine_config(settings))
    runner = engine_client.engine.engine.runner

    def broken(_: Any) -> Any:
        raise RuntimeError("injected device fault")

    monkeypatch.setattr(runner, "execute", broken)
    try:
        async with AsyncTestClient(app=create_app(settings, engine_client=engine_client)) as app:
            assert (await app.get("/healthz")).status_code == 200
            params = SamplingParams(max_tokens=2)
            for i in range(MAX_FAILED_STEPS):
                with pytest.raises(Exception, match="engine"):
                    async for _ in engine_client.generate(GenerateRequest([5, 6], params, f"r{i}")):
                        pass
            health = await app.get("/healthz")
            assert health.status_code == 503 and health.json() == {"status": "engine_dead"}
            assert (await app.get("/readyz")).status_code == 503
    finally:
        await engine_client.close()


async def test_a_huge_prompt_is_refused_before_it_is_tokenized(
    client: Client,
    tenant_key: str,
    sessions: Sessions,
    engine_client: InProcessEngineClient,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """More characters than the context holds in tokens: 400 at once, and the tokenizer
    never sees it (tokenizing megabytes froze the event loop for seconds)."""
    seen: list[int] = []
    encode = engine_client.encode

    def recording(text: str) -> list[int]:
        seen.append(len(text))
        return encode(text)

    monkeypatch.setattr(engine_client, "encode", recording)
    limit = engine_client.max_model_len * engine_client.max_token_chars
    model, headers = engine_client.model_name, _auth(tenant_key)
    chat = {"model": model, "messages": [{"role": "user", "content": "x" * (limit + 1)}]}
    response = await client.post("/v1/chat/completions", json=chat, headers=headers)
    error = await _assert_error(response, 400, "messages")
    assert error["code"] == "context_length_exceeded" and str(limit) in error["message"]
    text = {"model": model, "prompt": "y" * (limit + 1)}
    response = await client.post("/v1/completions", json=text, headers=headers)
    assert (await _assert_error(response, 400, "prompt"))["code"] == "context_length_exceeded"
    assert seen == []
    assert await _ledger(sessions) == []


async def test_a_body_over_the_limit_is_413(client: Client, tenant_key: str) -> None:
    body = b'{"model": "m", "prompt": "' + b"z" * (4 * 2**20) + b'"}'
    response = await client.post("/v1/completions", content=body, headers=_auth(tenant_key))
    assert response.status_code == 413


async def test_a_long_prompt_is_tokenized_off_the_event_loop(
    client: Client,
    tenant_key: str,
    engine_client: InProcessEngineClient,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import threading

    threads: list[str] = []
    encode = engine_client.encode

    def recording(text: str) -> list[int]:
        threads.append(threading.current_thread().name)
        return encode(text)

    monkeypatch.setattr(engine_client, "encode", recording)
    model, headers = engine_client.model_name, _auth(tenant_key)
    short = {"model": model, "prompt": "hello", "max_tokens": 1}
    long = {"model": model, "prompt": "-" * 5000, "max_tokens": 1}  # 158 tokens
    for body in (short, long):
        response = await client.post("/v1/completions", json=body, headers=headers)
        assert response.status_code == 200, response.text
    loop_thread, long_thread = threads
    assert long_thread != loop_thread


async def test_an_unreachable_database_is_a_retryable_503(
    settings: Any, engine_client: InProcessEngineClient
) -> None:
    """A database restart or failover is an outage to retry, not an internal error."""
    from dataclasses import replace

    from gateway.app import create_app
    from tenants import keys
    from tests.e2e.processes import free_port

    down = f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/nothing"
    app = create_app(replace(settings, database_url=down), engine_client=engine_client)
    async with AsyncTestClient(app=app) as client:
        body = {"model": engine_client.model_name, "prompt": "The", "max_tokens": 1}
        secret, _ = keys.generate_key()  # well formed, so the lookup reaches the database
        response = await client.post("/v1/completions", json=body, headers=_auth(secret))
    error = await _assert_error(response, 503)
    assert error["code"] == "database_unavailable" and response.headers["retry-after"] == "1"
