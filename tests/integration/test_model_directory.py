"""The model directory follows the registry: new models open, changed ones reopen,
removed ones close, and a model whose client cannot be built is a 503 until it can."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.core.errors import EngineUnavailable, NotFound
from gateway.dispatch.directory import ModelDirectory
from gateway.dispatch.engine_client import EngineClient
from tenants.adapters import AdapterService
from tenants.errors import ConflictError, InvalidInputError
from tenants.registry import ModelKind, ModelService, ModelSpec, Target
from tenants.services import TenantService

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


async def _tenant_with_adapter(sessions: Sessions, folder: Path, name: str, base: str) -> str:
    """A tenant owning an adapter called `name` (as the CLI adds it: no served names)."""
    async with sessions.begin() as session:
        owner = await TenantService(session).create(f"owner-of-{name.replace('/', '-')}")
        await AdapterService(session).add(name, base, str(folder), owner.name)
        return owner.id


def _adapter_folder(root: Path) -> Path:
    root.mkdir()
    config = {"peft_type": "LORA", "r": 4, "target_modules": ["q_proj"]}
    (root / "adapter_config.json").write_text(json.dumps(config))
    (root / "adapter_model.safetensors").write_bytes(b"\x02" + bytes(7) + b"{}")  # no tensors
    return root


async def test_an_adapter_named_as_a_served_model_cannot_hide_it(
    sessions: Sessions, tmp_path: Path
) -> None:
    """The default entry's name is in no table, so the CLI cannot refuse it: the model
    wins, for its tenant too, and the row is listed to nobody."""
    folder = _adapter_folder(tmp_path / "a")
    default = Client("tollgate-tiny")
    directory = ModelDirectory(sessions, Builder(), default)  # type: ignore[arg-type]
    owner = await _tenant_with_adapter(sessions, folder, "tollgate-tiny", "tollgate-tiny")
    await directory.refresh()
    for tenant in (owner, "another-tenant"):
        client, adapter = directory.resolve("tollgate-tiny", tenant)
        assert client is default and adapter is None  # type: ignore[comparison-overlap]
        assert directory.adapters_of(tenant) == []


async def test_an_adapter_of_a_model_not_served_is_not_found_by_its_own_name(
    sessions: Sessions, tmp_path: Path
) -> None:
    directory = ModelDirectory(sessions, Builder(), Client("tollgate-tiny"))  # type: ignore[arg-type]
    owner = await _tenant_with_adapter(sessions, _adapter_folder(tmp_path / "a"), "ft", "gone")
    await directory.refresh()
    with pytest.raises(NotFound) as missing:
        directory.resolve("ft", owner)
    assert "'ft'" in missing.value.message and "gone" not in missing.value.message


async def test_adding_checks_names_against_served_models_and_adapters(
    sessions: Sessions, tmp_path: Path
) -> None:
    folder = _adapter_folder(tmp_path / "a")
    await _tenant_with_adapter(sessions, folder, "ft", "tollgate-tiny")
    served = ["tollgate-tiny"]
    async with sessions.begin() as session:
        service = AdapterService(session)
        with pytest.raises(ConflictError):
            await service.add(
                "tollgate-tiny", "tollgate-tiny", str(folder), "owner-of-ft", served=served
            )
        for base in ("ft", "no-such-model"):  # an adapter, or a model this gateway lacks
            with pytest.raises(InvalidInputError, match="is not a served model"):
                await service.add("ft2", base, str(folder), "owner-of-ft", served=served)
        with pytest.raises(ConflictError, match="LoRA adapter"):
            await ModelService(session).add(
                ModelSpec("ft", ModelKind.OPENAI, (Target("http://127.0.0.1:9001"),))
            )
