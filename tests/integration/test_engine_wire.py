"""The engine's errors across the wire to a remote replica (backend/server.py, a real
server on loopback, to gateway/dispatch/remote.py): a refusal keeps the parameter it
names, and a defect is a 500 that keeps the replica in routing."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from backend import AsyncEngine, EngineConfig, SamplingParams
from backend.builtin import BUILTIN_MODEL_DIR
from backend.server import create_backend_app
from gateway.core.errors import InternalError, InvalidRequest
from gateway.dispatch.engine_client import GenerateRequest
from gateway.dispatch.remote import RemoteEngineClient
from tests.conftest import serving

pytestmark = pytest.mark.integration

PARAMS = SamplingParams(max_tokens=2, temperature=0)


@pytest.fixture
async def replica(tmp_path: Path) -> AsyncIterator[tuple[AsyncEngine, RemoteEngineClient]]:
    engine = AsyncEngine.from_pretrained(BUILTIN_MODEL_DIR, EngineConfig(cpu_threads=1))
    async with serving(create_backend_app(engine, BUILTIN_MODEL_DIR, secret="s3cret")) as url:
        remote = await RemoteEngineClient.connect([url], "s3cret", tmp_path)
        try:
            yield engine, remote
        finally:
            await remote.close()


async def _drain(remote: RemoteEngineClient, prompt: list[int], request_id: str) -> None:
    async for _ in remote.generate(GenerateRequest(prompt, PARAMS, request_id)):
        pass


async def test_a_refusal_carries_its_parameter_from_the_replica(
    replica: tuple[AsyncEngine, RemoteEngineClient],
) -> None:
    _, remote = replica
    with pytest.raises(InvalidRequest) as refused:
        await _drain(remote, [10**6], "past-the-vocabulary")
    assert refused.value.param == "prompt"
    assert "token ids" in refused.value.message
    assert remote.replicas[0].healthy
    await _drain(remote, [1, 2, 3], "after")  # and the replica still serves


async def test_a_value_error_on_the_replica_is_a_500_not_a_400(
    replica: tuple[AsyncEngine, RemoteEngineClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, remote = replica

    def defect(*_: object) -> None:
        raise ValueError("max_tokens looked wrong to a buggy line")

    monkeypatch.setattr(engine.engine, "add_request", defect)
    with pytest.raises(InternalError) as failed:
        await _drain(remote, [1, 2, 3], "hits-a-defect")
    assert failed.value.code == "request_failed"
    assert "max_tokens" not in failed.value.message
    assert remote.replicas[0].healthy
