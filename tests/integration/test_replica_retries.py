"""Which failures the gateway retries on another backend replica, against replicas that
are real HTTP servers on loopback speaking the internal API, each told how to behave."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
from litestar import Litestar, Request, Response, post
from litestar.response import Stream

from backend import RequestOutput, SamplingParams
from backend.builtin import BUILTIN_MODEL_DIR
from backend.tokenizer import Tokenizer
from backend.wire import ErrorLine, OutputLine
from gateway.core.errors import EngineUnavailable, InvalidRequest
from gateway.dispatch.engine_client import RESTART, GenerateRequest
from gateway.dispatch.remote import MAX_REPLICA_FAILURES, RemoteEngineClient
from tests.conftest import serving
from tests.e2e.processes import free_port

pytestmark = pytest.mark.integration


@dataclass
class Behaviour:
    """'ok': 4 outputs then finished; 'die': `before_death` outputs, then the connection
    breaks mid-stream; 'dead': the engine_dead error line; 'refuse': 422."""

    kind: str
    before_death: int = 0
    received: list[str] = field(default_factory=list)


def _output(request_id: str, i: int, finished: bool) -> bytes:
    out = RequestOutput(
        request_id, f"w{i}", [i], finished, "length" if finished else None, 3, i + 1
    )
    return msgspec.json.encode(OutputLine(out)) + b"\n"


def replica(behaviour: Behaviour) -> Litestar:
    @post("/internal/generate", status_code=200)
    async def generate(request: Request[Any, Any, Any]) -> Response[Any]:
        request_id = msgspec.json.decode(await request.body())["request_id"]
        behaviour.received.append(request_id)
        if behaviour.kind == "refuse":
            return Response({"error": "no such thing"}, status_code=422)

        async def lines() -> AsyncIterator[bytes]:
            if behaviour.kind == "dead":
                yield msgspec.json.encode(ErrorLine("engine_dead", "stopped")) + b"\n"
                return
            if behaviour.kind == "die":
                for i in range(behaviour.before_death):
                    yield _output(request_id, i, False)
                raise RuntimeError("replica died")  # uvicorn cuts the response short
            for i in range(4):
                yield _output(request_id, i, i == 3)

        return Stream(lines(), media_type="application/x-ndjson")

    return Litestar([generate], logging_config=None)


@contextlib.asynccontextmanager
async def client_over(
    *behaviours: Behaviour, unreachable: int = 0
) -> AsyncIterator[RemoteEngineClient]:
    """A client over a replica per behaviour, after `unreachable` URLs nothing listens on."""
    async with contextlib.AsyncExitStack() as stack:
        urls = [f"http://127.0.0.1:{free_port()}" for _ in range(unreachable)]
        urls += [await stack.enter_async_context(serving(replica(b))) for b in behaviours]
        client = RemoteEngineClient(urls, "secret", Tokenizer(BUILTIN_MODEL_DIR), "m", 64)
        try:
            yield client
        finally:
            await client.close()


async def _collect(client: RemoteEngineClient, restartable: bool) -> list[RequestOutput]:
    params = SamplingParams(max_tokens=4)
    return [
        out
        async for out in client.generate(
            GenerateRequest([1, 2, 3], params, "req_1", restartable=restartable)
        )
    ]


def _received(*behaviours: Behaviour) -> list[int]:
    return [len(b.received) for b in behaviours]


async def test_a_whole_response_starts_over_on_another_replica() -> None:
    dying, healthy = Behaviour("die", before_death=2), Behaviour("ok")
    async with client_over(dying, healthy) as client:
        client.replicas[1].in_flight = 100  # so routing tries the dying one first
        outputs = await _collect(client, restartable=True)
    texts = [out.text for out in outputs if out.finish_reason != RESTART]
    assert texts == ["w0", "w1", "w0", "w1", "w2", "w3"]
    assert [o.finish_reason for o in outputs].count(RESTART) == 1
    assert outputs[2].finish_reason == RESTART and outputs[-1].finished
    assert _received(dying) == [1]
    assert _received(healthy) == [1]


async def test_a_stream_that_reached_the_client_is_not_retried() -> None:
    dying, other = Behaviour("die", before_death=2), Behaviour("die", before_death=2)
    async with client_over(dying, other) as client:
        with pytest.raises(EngineUnavailable) as failed:
            await _collect(client, restartable=False)
    assert failed.value.code == "replica_failed"
    assert sorted(_received(dying, other)) == [0, 1]


async def test_a_refusal_is_not_retried_and_keeps_the_replica() -> None:
    refusing, second = Behaviour("refuse"), Behaviour("refuse")
    async with client_over(refusing, second) as client:
        with pytest.raises(InvalidRequest, match="no such thing"):  # the gateway's 400
            await _collect(client, restartable=True)
        assert sorted(_received(refusing, second)) == [0, 1]
        assert all(r.healthy for r in client.replicas)


async def test_a_request_that_kills_replicas_is_capped() -> None:
    killers = [Behaviour("die") for _ in range(MAX_REPLICA_FAILURES + 2)]
    async with client_over(*killers) as client:
        with pytest.raises(EngineUnavailable) as failed:
            await _collect(client, restartable=True)
    assert failed.value.code == "replica_failed"
    assert "not retried further" in failed.value.message
    assert sum(_received(*killers)) == MAX_REPLICA_FAILURES


async def test_a_dead_engines_error_line_moves_the_request_on() -> None:
    dead, healthy = Behaviour("dead"), Behaviour("ok")
    async with client_over(dead, healthy) as client:
        client.replicas[1].in_flight = 100  # so routing tries the dead one first
        outputs = await _collect(client, restartable=False)
        assert [out.text for out in outputs] == ["w0", "w1", "w2", "w3"]
        assert _received(dead, healthy) == [1, 1]
        assert [r.healthy for r in client.replicas] == [False, True]


async def test_unreachable_replicas_are_skipped_without_counting_as_failures() -> None:
    """A refused connection never reached the replica, so more of them than
    MAX_REPLICA_FAILURES still leave the request to the one that answers."""
    healthy = Behaviour("ok")
    async with client_over(healthy, unreachable=MAX_REPLICA_FAILURES + 1) as client:
        client.replicas[-1].in_flight = 100  # so routing tries the unreachable ones first
        outputs = await _collect(client, restartable=False)
        assert [out.text for out in outputs] == ["w0", "w1", "w2", "w3"]
        assert [r.healthy for r in client.replicas] == [False] * (MAX_REPLICA_FAILURES + 1) + [True]


async def test_with_every_replica_unreachable_the_answer_says_retry() -> None:
    async with client_over(unreachable=MAX_REPLICA_FAILURES + 1) as client:
        with pytest.raises(EngineUnavailable) as failed:
            await _collect(client, restartable=False)
    assert failed.value.code == "engine_unavailable"
    assert failed.value.headers["Retry-After"] == "1"
