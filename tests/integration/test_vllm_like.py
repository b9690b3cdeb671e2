"""The vLLM-like upstream of the tests (tests/support/vllm_like.py), on a real loopback
server, driven by the real `openai` SDK and httpx: what a gateway in front of it relies on."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.conftest import eventually, serving
from tests.e2e.processes import free_port
from tests.support.vllm_like import OUTPUT_TEXT, Config, create_app, render_chat, tokenize

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say something."}]


@contextlib.asynccontextmanager
async def upstream(**options: Any) -> AsyncIterator[str]:
    async with serving(create_app(Config(**options))) as url:
        yield url


def sdk(url: str, key: str = "none") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


async def sse_events(response: httpx.Response) -> AsyncIterator[Any]:
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            yield data if data == "[DONE]" else msgspec.json.decode(data)


async def recorded(http: httpx.AsyncClient, url: str) -> list[dict[str, Any]]:
    requests: list[dict[str, Any]] = (await http.get(f"{url}/_test/requests")).json()["requests"]
    return requests


async def gauges(http: httpx.AsyncClient, url: str) -> dict[str, float]:
    text = (await http.get(f"{url}/metrics")).text
    values = {}
    for line in text.splitlines():
        if line.startswith("vllm:") and 'model_name="vllm-like"' in line:
            name, value = line.split("{")[0], line.rsplit(" ", 1)[1]
            values[name] = float(value)
    return values


async def test_chat_stream_ends_with_vllms_usage_chunk() -> None:
    async with upstream() as url:
        stream = await sdk(url).chat.completions.create(  # type: ignore[call-overload]
            model="vllm-like",
            messages=MESSAGES,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == OUTPUT_TEXT[:16]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    prompt = len(render_chat(MESSAGES))
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (prompt, 16)
    assert all(c.usage is None for c in chunks[:-1])


async def test_raw_stream_has_no_usage_key_but_on_the_last_chunk() -> None:
    body = {"model": "vllm-like", "prompt": "hi", "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    async with (
        upstream() as url,
        httpx.AsyncClient() as http,
        http.stream("POST", f"{url}/v1/completions", json=body) as response,
    ):
        events = [event async for event in sse_events(response)]
    assert events[-1] == "[DONE]"
    *tokens, usage = events[:-1]
    assert [e["choices"][0]["text"] for e in tokens] == list(OUTPUT_TEXT[:4])
    assert all("usage" not in e for e in tokens)
    assert tokens[-1]["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == []
    assert usage["usage"]["total_tokens"] == 2 + 4


async def test_token_id_prompt_without_streaming() -> None:
    async with upstream() as url:
        done = await sdk(url).completions.create(model="vllm-like", prompt=[5, 6, 7], max_tokens=5)
    assert done.choices[0].text == OUTPUT_TEXT[:5]
    assert done.choices[0].finish_reason == "length"
    assert done.usage is not None
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (3, 5)


async def test_tokenize_counts_what_generation_bills() -> None:
    async with upstream(max_model_len=512) as url, httpx.AsyncClient() as http:
        chat = (await http.post(f"{url}/tokenize", json={"messages": MESSAGES})).json()
        text = (await http.post(f"{url}/tokenize", json={"model": "m", "prompt": "abc"})).json()
        bad = await http.post(f"{url}/tokenize", json={"prompt": 3})
        done = await sdk(url).chat.completions.create(model="vllm-like", messages=MESSAGES)
    assert done.usage is not None
    assert chat["count"] == done.usage.prompt_tokens == len(chat["tokens"])
    assert text == {"count": 3, "max_model_len": 512, "tokens": tokenize("abc"),
                    "token_strs": None}  # fmt: skip
    assert bad.status_code == 400
    assert "message" in bad.json()["error"]


async def test_models_health_and_api_key() -> None:
    async with upstream(api_key="sk-up", model="m1") as url, httpx.AsyncClient() as http:
        listed = await sdk(url, "sk-up").models.list()
        assert (await http.get(f"{url}/health")).status_code == 200
        with pytest.raises(openai.AuthenticationError):
            await sdk(url, "wrong").chat.completions.create(model="m1", messages=MESSAGES)
        with pytest.raises(openai.NotFoundError):
            await sdk(url, "sk-up").chat.completions.create(model="m2", messages=MESSAGES)
    assert [m.id for m in listed.data] == ["m1"]
    assert listed.data[0].owned_by == "vllm"


async def test_metrics_follow_the_real_load() -> None:
    async with (
        upstream(delay_ms=20, tokens=1000, max_num_seqs=1) as url,
        httpx.AsyncClient(timeout=30) as http,
    ):
        body = {"model": "vllm-like", "prompt": "abcd", "stream": True}
        first = asyncio.create_task(http.post(f"{url}/v1/completions", json=body))
        await eventually(lambda: _running(http, url, 1, 0))
        second = asyncio.create_task(http.post(f"{url}/v1/completions", json=body))
        await eventually(lambda: _running(http, url, 1, 1))
        kv = (await gauges(http, url))["vllm:kv_cache_usage_perc"]
        assert 4 / Config.kv_capacity_tokens < kv < 1
        first.cancel()
        second.cancel()
        await asyncio.gather(first, second, return_exceptions=True)
        await eventually(lambda: _running(http, url, 0, 0))
        assert (await gauges(http, url))["vllm:kv_cache_usage_perc"] == 0


async def _running(http: httpx.AsyncClient, url: str, running: int, waiting: int) -> bool:
    values = await gauges(http, url)
    return (values["vllm:num_requests_running"], values["vllm:num_requests_waiting"]) == (
        running,
        waiting,
    )


async def test_a_disconnect_mid_stream_aborts_generation() -> None:
    async with upstream(delay_ms=20, tokens=1000) as url, httpx.AsyncClient(timeout=30) as http:
        body = {"model": "vllm-like", "messages": MESSAGES, "stream": True, "cache_salt": "t-1"}
        async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            events = sse_events(response)
            for _ in range(3):
                await anext(events)
        await eventually(lambda: _aborted(http, url))
        [record] = await recorded(http, url)
        sent = record["tokens_sent"]
        assert 2 <= sent < 1000
        assert record["body"]["cache_salt"] == "t-1"
        assert not record["finished"]
        await eventually(lambda: _running(http, url, 0, 0))
        assert (await recorded(http, url))[0]["tokens_sent"] == sent  # it stopped producing


async def test_a_disconnect_without_streaming_aborts_too() -> None:
    async with upstream(delay_ms=20, tokens=1000) as url, httpx.AsyncClient() as http:
        body = {"model": "vllm-like", "prompt": [1, 2], "priority": 3}
        with pytest.raises(httpx.ReadTimeout):
            await http.post(f"{url}/v1/completions", json=body, timeout=0.3)
        await eventually(lambda: _aborted(http, url))
        [record] = await recorded(http, url)
        assert record["body"]["priority"] == 3
        assert record["tokens_sent"] < 1000


async def _aborted(http: httpx.AsyncClient, url: str) -> bool:
    return any(r["aborted"] for r in await recorded(http, url))


async def test_lower_priority_value_runs_first() -> None:
    async with (
        upstream(delay_ms=5, tokens=20, max_num_seqs=1) as url,
        httpx.AsyncClient(timeout=30) as http,
    ):
        finished: list[int] = []

        async def send(priority: int) -> None:
            body = {"model": "vllm-like", "prompt": "x", "priority": priority}
            response = await http.post(f"{url}/v1/completions", json=body)
            assert response.status_code == 200
            finished.append(priority)

        tasks = [asyncio.create_task(send(1))]
        await eventually(lambda: _running(http, url, 1, 0))
        for waiting, priority in enumerate((9, 0), start=1):
            tasks.append(asyncio.create_task(send(priority)))
            await eventually(lambda w=waiting: _running(http, url, 1, w))  # type: ignore[misc]
        await asyncio.gather(*tasks)

    assert finished == [1, 0, 9]


async def test_priority_is_refused_under_fcfs() -> None:
    async with upstream(scheduling_policy="fcfs") as url:
        with pytest.raises(openai.BadRequestError):
            await sdk(url).completions.create(
                model="vllm-like", prompt="x", extra_body={"priority": 1}
            )


async def test_upstream_errors_carry_retry_after() -> None:
    async with upstream() as url, httpx.AsyncClient() as http:
        with pytest.raises(openai.RateLimitError) as limited:
            await sdk(url).chat.completions.create(
                model="vllm-like",
                messages=MESSAGES,
                extra_headers={"x-test-fail": "429"},
            )
        assert limited.value.response.headers["retry-after"] == "1"
        await http.post(f"{url}/_test/fail", json={"status": 503, "retry_after": 7})
        unavailable = await http.post(f"{url}/v1/completions", json={"prompt": "x"})
        after = await http.post(f"{url}/v1/completions", json={"prompt": "x"})
    assert unavailable.status_code == 503
    assert unavailable.headers["retry-after"] == "7"
    assert unavailable.json()["error"]["code"] == 503
    assert after.status_code == 200


async def test_prompt_past_the_context_is_refused() -> None:
    async with upstream(max_model_len=8) as url:
        with pytest.raises(openai.BadRequestError, match="maximum context length"):
            await sdk(url).completions.create(model="vllm-like", prompt=[1] * 8)


async def test_runs_as_a_process() -> None:
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "tests.support.vllm_like",
        "--port",
        str(port),
        "--tokens",
        "3",
    ]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient() as http:
            await eventually(lambda: _answers(http, url), timeout_s=30)
            done = await sdk(url).completions.create(model="vllm-like", prompt="x")
        assert done.choices[0].text == OUTPUT_TEXT[:3]
    finally:
        process.terminate()
        process.wait(timeout=10)


async def _answers(http: httpx.AsyncClient, url: str) -> bool:
    try:
        return (await http.get(f"{url}/health")).status_code == 200
    except httpx.TransportError:
        return False
