"""The poison table (tests/support/poison.py) replayed on the embedded default and on the
stack (PostgreSQL, Redis, a gateway over two backend replicas): each answer is the one
expected, never a 5xx, and another tenant's ordinary request sent beside it is served
within a bound of its unloaded time. No backend dies on the way."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import httpx
import pytest

from backend.wire import SECRET_HEADER
from gateway.app import create_app
from gateway.cli.bootstrap import ensure_admin_key
from gateway.dispatch.engine_client import InProcessEngineClient
from gateway.settings import Settings
from tenants import db, keys
from tests.conftest import POSTGRES_URL, REDIS_URL, migrated_postgres, serving
from tests.e2e.processes import free_port, running, start
from tests.support.poison import table

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

Send = Callable[[str, str, bytes], Awaitable[httpx.Response]]


@dataclass
class Target:
    base: str  # .../v1
    keys: tuple[str, str]  # the poisoner's and the bystander's
    model: str
    max_model_len: int
    backends: list[str]  # backend replica URLs (stack mode)
    secret: str = ""


async def _tenant_keys(http: httpx.AsyncClient, base: str, admin: str) -> tuple[str, str]:
    found = []
    for name in (f"poisoner-{secrets.token_hex(3)}", f"bystander-{secrets.token_hex(3)}"):
        auth = {"Authorization": f"Bearer {admin}"}
        created = await http.post(f"{base}/admin/api/tenants", json={"name": name}, headers=auth)
        assert created.status_code == 201, created.text
        key = await http.post(f"{base}/admin/api/tenants/{name}/keys", json={}, headers=auth)
        found.append(key.json()["key"])
    return found[0], found[1]


async def _model(http: httpx.AsyncClient, base: str, key: str) -> tuple[str, int]:
    card = await http.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {key}"})
    first = card.json()["data"][0]
    return first["id"], first["max_model_len"]


@pytest.fixture(scope="module")
async def embedded(
    tmp_path_factory: pytest.TempPathFactory, engine_client: InProcessEngineClient
) -> AsyncIterator[Target]:
    folder = tmp_path_factory.mktemp("poison")
    admin, _ = keys.generate_key()
    url = f"sqlite:///{folder / 'tollgate.db'}"
    db.upgrade(url)
    settings = replace(
        Settings.from_env({}), database_url=url, data_dir=folder / "data", admin_key=admin
    )
    engine = db.create_engine(url)
    await ensure_admin_key(settings, db.session_factory(engine))
    await engine.dispose()
    async with serving(create_app(settings, engine_client=engine_client)) as base:
        async with httpx.AsyncClient(timeout=60) as http:
            pair = await _tenant_keys(http, base, admin)
            model, context = await _model(http, base, pair[1])
        yield Target(f"{base}/v1", pair, model, context, [])


@pytest.fixture(scope="module")
def stack() -> Iterator[Target]:
    migrated_postgres()
    secret, (admin, _) = secrets.token_hex(16), keys.generate_key()
    common = {
        "TOLLGATE_BACKEND_SECRET": secret,
        "TOLLGATE_MODEL": os.environ.get("TOLLGATE_TEST_MODEL", ""),
    }
    ports = [free_port(), free_port()]
    backends = [start(["backend", "serve", "--port", str(p)], common) for p in ports]
    with running(*backends):
        for process in backends:
            process.wait_for("ready on")
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        gateway_port = free_port()
        gateway = start(
            ["serve", "--port", str(gateway_port)],
            {
                **common,
                "TOLLGATE_BACKENDS": ",".join(urls),
                "TOLLGATE_DATABASE_URL": POSTGRES_URL,
                "TOLLGATE_REDIS_URL": REDIS_URL,
                "TOLLGATE_ADMIN_KEY": admin,
            },
        )
        with running(gateway):
            gateway.wait_for('"model"')
            base = f"http://127.0.0.1:{gateway_port}"

            async def setup() -> tuple[tuple[str, str], str, int]:
                async with httpx.AsyncClient(timeout=60) as http:
                    pair = await _tenant_keys(http, base, admin)
                    return (pair, *await _model(http, base, pair[1]))

            pair, model, context = asyncio.run(setup())
            yield Target(f"{base}/v1", pair, model, context, urls, secret)


async def _send(http: httpx.AsyncClient, target: Target, key: str, path: str, body: bytes) -> Any:
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    return await http.post(f"{target.base}{path}", content=body, headers=headers)


async def _ordinary(http: httpx.AsyncClient, target: Target) -> float:
    body = f'{{"model": "{target.model}", "prompt": "Return the", "max_tokens": 4}}'.encode()
    started = time.monotonic()
    response = await _send(http, target, target.keys[1], "/completions", body)
    assert response.status_code == 200, response.text
    return time.monotonic() - started


async def _replay(target: Target) -> None:
    failures = []
    async with httpx.AsyncClient(timeout=120) as http:
        unloaded = max([await _ordinary(http, target) for _ in range(3)])
        bound = max(10 * unloaded, 5.0)  # a stall (seconds of a frozen loop) is far past it
        for poison in table(target.model, target.max_model_len):
            sent = asyncio.ensure_future(
                _send(http, target, target.keys[0], poison.path, poison.body)
            )
            beside = await _ordinary(http, target)
            answer = await sent
            if answer.status_code not in poison.statuses or beside > bound:
                failures.append((poison.name, answer.status_code, answer.text[:200], beside))
            for url in target.backends:
                alive = await http.get(f"{url}/healthz")
                assert alive.status_code == 200, f"{poison.name} killed backend {url}"
        assert failures == [], f"unloaded {unloaded:.3f}s, bound {bound:.1f}s"
        assert (await http.get(target.base.removesuffix("/v1") + "/healthz")).status_code == 200


async def test_poison_requests_on_the_embedded_default(embedded: Target) -> None:
    await _replay(embedded)


async def test_poison_requests_on_the_stack(stack: Target) -> None:
    await _replay(stack)
    async with httpx.AsyncClient(timeout=30) as http:
        for url in stack.backends:  # nothing left running: every poison settled or aborted
            stats = await http.get(f"{url}/internal/stats", headers={SECRET_HEADER: stack.secret})
            assert stats.json()["num_running"] == 0


async def test_tiny_temperatures_never_cut_another_tenants_stream(embedded: Target) -> None:
    """Issue 32 item 3: temperature 1e-300 is 0 in float32. Its NaN row once sampled an id
    past the vocabulary, the next step raised, and every stream in that batch died."""
    poison = json.dumps(
        {
            "model": embedded.model,
            "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 8,
            "temperature": 1e-300,
        }
    ).encode()
    stream = {
        "model": embedded.model,
        "messages": [{"role": "user", "content": "Count to ten."}],
        "max_tokens": 64,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {embedded.keys[1]}"}
    async with httpx.AsyncClient(timeout=120) as http:
        flood = asyncio.gather(
            *(
                _send(http, embedded, embedded.keys[0], "/chat/completions", poison)
                for _ in range(8)
            )
        )
        url = f"{embedded.base}/chat/completions"
        async with http.stream("POST", url, json=stream, headers=headers) as response:
            assert response.status_code == 200
            events = [line async for line in response.aiter_lines() if line.startswith("data: ")]
        answers = await flood
    assert [a.status_code for a in answers] == [200] * 8, answers[0].text
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert not [c for c in chunks if "error" in c]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_logit_bias_and_min_p_are_honoured_through_the_api(embedded: Target) -> None:
    """Issue 32 item 16: logit_bias was silently ignored. +100 on one token makes every
    output token that one (two different tokens, two different repetitive texts); min_p
    of 1 at temperature 1 keeps only the most likely token: the greedy text."""
    headers = {"Authorization": f"Bearer {embedded.keys[1]}"}

    async def complete(http: httpx.AsyncClient, **fields: Any) -> str:
        body = {"model": embedded.model, "prompt": "def add(a, b):", "max_tokens": 6}
        reply = await http.post(
            f"{embedded.base}/completions", json={**body, **fields}, headers=headers
        )
        assert reply.status_code == 200, reply.text
        return str(reply.json()["choices"][0]["text"])

    async with httpx.AsyncClient(timeout=60) as http:
        forced = [await complete(http, logit_bias={str(t): 100}, ignore_eos=True) for t in (70, 71)]
        greedy = await complete(http, temperature=0)
        narrowed = await complete(http, temperature=1, min_p=1)
    for text in forced:
        assert text and text == text[: len(text) // 6] * 6, text
    assert forced[0] != forced[1]
    assert narrowed == greedy


async def test_stop_token_ids_end_the_output_at_that_token(embedded: Target) -> None:
    """vLLM's `stop_token_ids` (issue 32 item 16: honoured, not ignored). Every token
    forced to one id by logit_bias runs to the length; that id as a stop token ends the
    output at its first token, `stop`."""
    headers = {"Authorization": f"Bearer {embedded.keys[1]}"}
    body = {"model": embedded.model, "prompt": "def add(a, b):", "max_tokens": 6}
    body |= {"logit_bias": {"70": 100}, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=60) as http:
        url = f"{embedded.base}/completions"
        forced = await http.post(url, json=body, headers=headers)
        stopped = await http.post(url, json={**body, "stop_token_ids": [70]}, headers=headers)
    assert forced.status_code == stopped.status_code == 200, stopped.text
    assert forced.json()["choices"][0]["finish_reason"] == "length"
    assert forced.json()["usage"]["completion_tokens"] == 6
    assert stopped.json()["choices"][0]["finish_reason"] == "stop"
    assert stopped.json()["usage"]["completion_tokens"] == 1


async def test_functions_are_read_as_tools(embedded: Target) -> None:
    """Issue 32 item 16: `functions` / `function_call` (OpenAI's older form of tools)
    were ignored; a named function_call now forces that function's call."""
    headers = {"Authorization": f"Bearer {embedded.keys[1]}"}
    weather = {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
        },
    }
    body = {
        "model": embedded.model,
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "max_tokens": 64,
        "functions": [weather],
        "function_call": {"name": "get_weather"},
    }
    url = f"{embedded.base}/chat/completions"
    async with httpx.AsyncClient(timeout=60) as http:
        reply = await http.post(url, json=body, headers=headers)
        streamed = await http.post(url, json={**body, "stream": True}, headers=headers)
        both = await http.post(url, json={**body, "tools": []}, headers=headers)
    assert reply.status_code == 200, reply.text
    # Answered in the legacy API's shape, as OpenAI answers a functions request.
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "function_call" and "tool_calls" not in choice["message"]
    assert choice["message"]["function_call"]["name"] == "get_weather"
    # Sampled (no temperature given): the schema allows any string of up to 8, "" too.
    assert isinstance(json.loads(choice["message"]["function_call"]["arguments"])["city"], str)
    events = [line.removeprefix("data: ") for line in streamed.text.splitlines()]
    chunks = [json.loads(e) for e in events if e.startswith("{")]
    calls = [
        c["choices"][0]["delta"]["function_call"]
        for c in chunks
        if c["choices"] and "function_call" in c["choices"][0]["delta"]
    ]
    assert calls[0]["name"] == "get_weather" and calls[0]["arguments"] == ""
    assert isinstance(json.loads("".join(c["arguments"] for c in calls))["city"], str)
    assert chunks[-1]["choices"][0]["finish_reason"] == "function_call"
    assert both.status_code == 400 and both.json()["error"]["param"] == "functions", both.text
