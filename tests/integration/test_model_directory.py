"""The model directory follows the registry: new models open, changed ones reopen,
removed ones close, and a model whose client cannot be built is a 503 until it can."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.core.errors import EngineUnavailable, NotFound
from gateway.dispatch.directory import ModelDirectory
from gateway.dispatch.engine_client import EngineClient
from tenants.registry import ModelKind, ModelService, ModelSpec, Target

Sessions = async_sessionmaker[AsyncSession]


@dataclass
class Client:
    """A stand-in client: the directory only names, holds and closes clients."""

    model_name: str
    closed: bool = False

    async def close(self) -> None:
        self.closed = True


class Builder:
    def __init__(self) -> None:
        self.built: list[Client] = []
        self.down: set[str] = set()  # targets that refuse to open

    async def __call__(self, spec: ModelSpec) -> EngineClient:
        if spec.targets[0].url in self.down:
            raise ConnectionError(spec.targets[0].url)
        client = Client(spec.name)
        self.built.append(client)
        return client  # type: ignore[return-value]


async def _add(sessions: Sessions, name: str, url: str) -> None:
    async with sessions.begin() as session:
        await ModelService(session).add(ModelSpec(name, ModelKind.OPENAI, (Target(url),)))


async def test_the_directory_follows_adds_changes_and_removals(sessions: Sessions) -> None:
    build = Builder()
    default = Client("tollgate-tiny")
    directory = ModelDirectory(sessions, build, default)  # type: ignore[arg-type]
    await directory.refresh()
    assert directory.names() == ["tollgate-tiny"]
    assert directory.get("tollgate-tiny") is default  # type: ignore[comparison-overlap]

    await _add(sessions, "llama", "http://127.0.0.1:9001")
    await directory.refresh()
    first = directory.get("llama")
    assert directory.names() == ["tollgate-tiny", "llama"]
    await directory.refresh()
    assert directory.get("llama") is first  # unchanged: the same client

    async with sessions.begin() as session:
        await ModelService(session).update("llama", targets=(Target("http://127.0.0.1:9002"),))
    await directory.refresh()
    assert first.closed  # type: ignore[attr-defined]
    assert directory.get("llama") is not first

    async with sessions.begin() as session:
        await ModelService(session).remove("llama")
    await directory.refresh()
    with pytest.raises(NotFound) as missing:
        directory.get("llama")
    assert missing.value.code == "model_not_found"
    assert all(c.closed for c in build.built)
    await directory.close()
    assert not default.closed  # the default entry is its owner's to close


async def test_an_unreachable_model_is_503_until_its_client_opens(sessions: Sessions) -> None:
    build = Builder()
    build.down.add("http://127.0.0.1:9003")
    directory = ModelDirectory(sessions, build)  # type: ignore[arg-type]
    await _add(sessions, "late", "http://127.0.0.1:9003")
    await directory.refresh()
    with pytest.raises(EngineUnavailable):
        directory.get("late")
    build.down.clear()
    await directory.refresh()
    assert directory.get("late").model_name == "late"
    await directory.close()
