"""Graceful drain, process level: `tollgate serve` and `tollgate backend serve` on SIGTERM
turn not-ready first, refuse new requests with 503, let the stream in flight finish,
settle, and exit 0; a gateway stops routing to a draining backend."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from sqlalchemy import create_engine, text

from backend.sampling import SamplingParams
from backend.wire import LINES, GenerateBody, OutputLine
from gateway.dispatch.engine_client import GenerateRequest
from gateway.dispatch.remote import RemoteEngineClient
from tests.conftest import eventually
from tests.e2e.processes import Process, free_port, running, start

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

SECRET = "drain-secret"
LONG_TOKENS = 1000  # outlasts the checks made while it streams (a second or more, even when fast)
EXIT_TIMEOUT_S = 60


def _exit_code(process: Process) -> int:
    try:
        return process.popen.wait(timeout=EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"still running after the drain:\n{process.text}") from None


# --- the gateway ------------------------------------------------------------------------


class Gateway:
    def __init__(self, process: Process, port: int, key: str, model: str, db: Path) -> None:
        self.process, self.key, self.model, self.db = process, key, model, db
        self.url = f"http://127.0.0.1:{port}"

    def chat(self, max_tokens: int, stream: bool) -> dict[str, Any]:
        return {
            "model": self.model,
            "messages": [{"role": "user", "content": "Tell me about sorting."}],
            "max_tokens": max_tokens,
            "stream": stream,
            "ignore_eos": True,
            "temperature": 0,
        }

    def usage_rows(self) -> list[tuple[str, int]]:
        engine = create_engine(f"sqlite:///{self.db}")
        try:
            with engine.connect() as connection:
                rows = connection.execute(
                    text("SELECT status, completion_tokens FROM usage_events")
                )
                return [(str(status), int(tokens)) for status, tokens in rows]
        finally:
            engine.dispose()


def _start_gateway(tmp_path: Path, drain_s: int, **env_extra: str) -> Iterator[Gateway]:
    port = free_port()
    env = {
        "TOLLGATE_DATA_DIR": str(tmp_path),
        "TOLLGATE_DATABASE_URL": "",
        "TOLLGATE_ADMIN_KEY": "",
        "TOLLGATE_MODEL": "",
        "TOLLGATE_DRAIN_S": str(drain_s),
        **env_extra,
    }
    process = start(["serve", "--port", str(port)], env)
    with running(process):
        banner = process.wait_for('"model"')
        key = next(w for w in banner.split() if w.startswith("tg-"))
        model = banner.split('"model": "')[1].split('"')[0]
        yield Gateway(process, port, key, model, tmp_path / "tollgate.db")


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[Gateway]:
    yield from _start_gateway(tmp_path, drain_s=60)


@pytest.fixture
def impatient_gateway(tmp_path: Path) -> Iterator[Gateway]:
    yield from _start_gateway(tmp_path, drain_s=1, TOLLGATE_MAX_NUM_SEQS="1")


async def _sse(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    async for line in lines:
        if line.startswith("data: "):
            yield line.removeprefix("data: ")


async def test_gateway_finishes_its_stream_then_exits(gateway: Gateway) -> None:
    headers = {"Authorization": f"Bearer {gateway.key}"}
    async with (
        httpx.AsyncClient(base_url=gateway.url, headers=headers, timeout=60) as client,
        client.stream("POST", "/v1/chat/completions", json=gateway.chat(LONG_TOKENS, True)) as sse,
    ):
        assert sse.status_code == 200
        events = _sse(sse.aiter_lines())
        first = await anext(events)  # streaming has started
        gateway.process.popen.send_signal(signal.SIGTERM)

        async def not_ready() -> bool:
            return (await client.get("/readyz")).status_code == 503

        await eventually(not_ready)
        refused = await client.post("/v1/chat/completions", json=gateway.chat(4, False))
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "draining"
        assert refused.headers["retry-after"] == "1"
        assert gateway.process.popen.poll() is None  # still serving the stream
        rest = [first] + [event async for event in events]
    assert rest[-1] == "[DONE]"
    chunks = [json.loads(event) for event in rest[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert _exit_code(gateway.process) == 0
    assert gateway.usage_rows() == [("completed", LONG_TOKENS)]  # settled before exit


async def test_gateway_drain_is_bounded_and_settles(impatient_gateway: Gateway) -> None:
    """More work than the drain (1 s) allows: one engine slot, four long streams. Once
    the grace period is over they are cut like a client disconnect, each settles (a
    usage row), and the process exits."""
    gateway = impatient_gateway
    headers = {"Authorization": f"Bearer {gateway.key}"}
    async with httpx.AsyncClient(base_url=gateway.url, headers=headers, timeout=60) as client:
        streams = [asyncio.create_task(_read_stream(client, gateway)) for _ in range(4)]

        async def all_in_engine() -> bool:
            metrics = (await client.get("/metrics")).text
            return "tollgate_engine_requests_waiting 3.0" in metrics

        await eventually(all_in_engine, timeout_s=30)
        signalled = time.monotonic()
        gateway.process.popen.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(_exit_code, gateway.process) == 0
        assert time.monotonic() - signalled < EXIT_TIMEOUT_S
        outcomes = await asyncio.gather(*streams)
    assert "cut" in outcomes, gateway.process.text
    rows = gateway.usage_rows()  # settled before exit: one row each, cut ones cancelled
    assert len(rows) == 4 and {status for status, _ in rows} <= {"completed", "cancelled"}
    assert [tokens for status, tokens in rows if status == "cancelled"]


async def _read_stream(client: httpx.AsyncClient, gateway: Gateway) -> str:
    body = gateway.chat(LONG_TOKENS, True)
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as sse:
            events = [event async for event in _sse(sse.aiter_lines())]
    except httpx.HTTPError:
        return "cut"
    return "done" if events and events[-1] == "[DONE]" else "cut"


# --- backends ---------------------------------------------------------------------------


@pytest.fixture
def backends() -> Iterator[list[tuple[Process, str]]]:
    started = []
    for _ in range(2):
        port = free_port()
        env = {"TOLLGATE_BACKEND_SECRET": SECRET, "TOLLGATE_DRAIN_S": "60", "TOLLGATE_MODEL": ""}
        started.append((start(["backend", "serve", "--port", str(port)], env), port))
    with running(*(process for process, _ in started)):
        for process, _ in started:
            process.wait_for("ready on")
        yield [(process, f"http://127.0.0.1:{port}") for process, port in started]


def _generate_body(request_id: str, max_tokens: int) -> bytes:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
    return msgspec.json.encode(GenerateBody(list(range(3, 40)), params, request_id))


async def _finished_requests(client: httpx.AsyncClient, url: str) -> float:
    """Requests that left this replica's engine (its tollgate_engine_requests_total)."""
    metrics = (await client.get(f"{url}/metrics")).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("tollgate_engine_requests_total{")
    )


async def test_backend_drains_and_gateways_route_around_it(
    backends: list[tuple[Process, str]], tmp_path: Path
) -> None:
    (draining, a_url), (_, b_url) = backends
    headers = {"x-tollgate-secret": SECRET, "Authorization": f"Bearer {SECRET}"}
    remote = await RemoteEngineClient.connect([a_url, b_url], SECRET, tmp_path)
    async with httpx.AsyncClient(headers=headers, timeout=60) as client:
        try:
            body = _generate_body("long", LONG_TOKENS)
            async with client.stream("POST", f"{a_url}/internal/generate", content=body) as long:
                lines = long.aiter_lines()
                await anext(lines)  # it is running on A
                draining.popen.send_signal(signal.SIGTERM)

                async def a_not_ready() -> bool:
                    return (await client.get(f"{a_url}/readyz")).status_code == 503

                await eventually(a_not_ready)
                stats = (await client.get(f"{a_url}/internal/stats")).json()
                assert stats["running"] is False and stats["num_running"] == 1
                refused = await client.post(f"{a_url}/internal/generate", content=body)
                assert refused.status_code == 503
                await remote.refresh()
                assert [r.healthy for r in remote.replicas] == [False, True]
                before = (
                    await _finished_requests(client, a_url),
                    await _finished_requests(client, b_url),
                )
                await asyncio.gather(*(_run(remote, f"new-{i}") for i in range(3)))
                after = (
                    await _finished_requests(client, a_url),
                    await _finished_requests(client, b_url),
                )
                assert after == (before[0], before[1] + 3)  # all three went to B
                outputs = [LINES.decode(line) async for line in lines if line]
            last = outputs[-1]
            assert isinstance(last, OutputLine)
            assert last.output.finished and last.output.completion_tokens == LONG_TOKENS
        finally:
            await remote.close()
    assert _exit_code(draining) == 0


async def _run(remote: RemoteEngineClient, request_id: str) -> None:
    params = SamplingParams(max_tokens=4, temperature=0)
    async for out in remote.generate(GenerateRequest(list(range(5, 30)), params, request_id)):
        if out.finished:
            return
