"""The model registry's domain: checked specs, audited changes, no keys stored."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from backend.builtin import BUILTIN_MODEL_DIR
from tenants.audit import Actor, AuditEvent
from tenants.errors import ConflictError, InvalidInputError, NotFoundError
from tenants.registry import ModelKind, ModelService, ModelSpec, Target, model_view

Sessions = async_sessionmaker[AsyncSession]
OPERATOR = Actor("admin:ops")


def vllm(name: str = "llama-8b", *urls: str) -> ModelSpec:
    targets = tuple(Target(u) for u in (urls or ("http://127.0.0.1:8001/",)))
    return ModelSpec(name, ModelKind.OPENAI, targets, api_key_env="TOLLGATE_UPSTREAM_KEY_VLLM")


async def _events(sessions: Sessions) -> list[AuditEvent]:
    async with sessions() as session:
        rows = await session.execute(select(AuditEvent).order_by(AuditEvent.id))
        return [e for e in rows.scalars() if e.action.startswith("model.")]


async def test_add_update_remove_each_write_one_audit_event(sessions: Sessions) -> None:
    async with sessions.begin() as session:
        row = await ModelService(session, OPERATOR).add(vllm())
        assert row.targets == [{"url": "http://127.0.0.1:8001", "weight": 1}]
    async with sessions.begin() as session:
        pool = (Target("http://127.0.0.1:8001"), Target("http://127.0.0.1:8002", 3))
        await ModelService(session, OPERATOR).update("llama-8b", targets=pool)
    async with sessions.begin() as session:
        await ModelService(session, OPERATOR).remove("llama-8b")
    events = await _events(sessions)
    assert [(e.action, e.target, e.actor) for e in events] == [
        ("model.add", "model:llama-8b", "admin:ops"),
        ("model.update", "model:llama-8b", "admin:ops"),
        ("model.remove", "model:llama-8b", "admin:ops"),
    ]
    assert events[1].details["changes"]["targets"][1][1] == {
        "url": "http://127.0.0.1:8002",
        "weight": 3,
    }
    async with sessions() as session:
        assert await ModelService(session).list() == []


async def test_a_failed_transaction_leaves_no_model_and_no_event(sessions: Sessions) -> None:
    async def add_then_fail() -> None:
        async with sessions.begin() as session:
            await ModelService(session, OPERATOR).add(vllm())
            raise RuntimeError("the caller failed after adding")

    with pytest.raises(RuntimeError):
        await add_then_fail()
    async with sessions() as session:
        assert await ModelService(session).find("llama-8b") is None
    assert await _events(sessions) == []


async def test_names_are_unique_and_unknown_ones_are_not_found(sessions: Sessions) -> None:
    async with sessions.begin() as session:
        await ModelService(session).add(vllm())
        with pytest.raises(ConflictError):
            await ModelService(session).add(vllm())
        with pytest.raises(NotFoundError):
            await ModelService(session).update("nope", context_length=4096)
        with pytest.raises(InvalidInputError, match="cannot change owner"):
            await ModelService(session).update("llama-8b", owner="someone")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (ModelSpec("bad name", ModelKind.OPENAI, (Target("http://h"),)), "model name"),
        (ModelSpec("m", ModelKind.OPENAI, ()), "at least one target"),
        (ModelSpec("m", ModelKind.OPENAI, (Target("ftp://h"),)), "http"),
        (ModelSpec("m", ModelKind.OPENAI, (Target("http://u:p@h"),)), "credentials"),
        (ModelSpec("m", ModelKind.OPENAI, (Target("http://h", 0),)), "weight"),
        (ModelSpec("m", ModelKind.OPENAI, (Target("http://h"), Target("http://h/"))), "twice"),
        (ModelSpec("m", ModelKind.OPENAI, (Target("http://h"),), api_key_env="sk-123"), "name"),
        (
            ModelSpec(
                "m", ModelKind.OPENAI, (Target("http://h"),), api_key_env="TOLLGATE_DATABASE_URL"
            ),
            "TOLLGATE_UPSTREAM_KEY_<NAME>",
        ),
        (
            ModelSpec(
                "m", ModelKind.OPENAI, (Target("http://h"),), api_key_env="TOLLGATE_STRIPE_API_KEY"
            ),
            "TOLLGATE_UPSTREAM_KEY_<NAME>",
        ),
        (
            ModelSpec(
                "m", ModelKind.OPENAI, (Target("http://h"),), api_key_env="TOLLGATE_BACKEND_SECRET"
            ),
            "TOLLGATE_UPSTREAM_KEY_<NAME>",
        ),
        (
            ModelSpec("m", ModelKind.OPENAI, (Target("http://h"),), api_key_env="VLLM_API_KEY"),
            "TOLLGATE_UPSTREAM_KEY_<NAME>",
        ),
        (
            ModelSpec(
                "m", ModelKind.OPENAI, (Target("http://h"),), api_key_env="TOLLGATE_UPSTREAM_KEY_"
            ),
            "TOLLGATE_UPSTREAM_KEY_<NAME>",
        ),
        (ModelSpec("m", ModelKind.OPENAI, (Target("http://h"),), context_length=0), "context"),
        (ModelSpec("m", ModelKind.TOLLGATE, (Target("http://h"),), tokenizer="rel"), "absolute"),
    ],
)
async def test_bad_specs_are_refused_with_the_reason(
    sessions: Sessions, spec: ModelSpec, message: str
) -> None:
    async with sessions.begin() as session:
        with pytest.raises(InvalidInputError, match=message):
            await ModelService(session).add(spec)


async def test_a_local_tokenizer_must_hold_tokenizer_json(
    sessions: Sessions, tmp_path: Path
) -> None:
    async with sessions.begin() as session:
        spec = ModelSpec("m", ModelKind.TOLLGATE, (Target("http://h"),), tokenizer=str(tmp_path))
        with pytest.raises(InvalidInputError, match=r"tokenizer\.json"):
            await ModelService(session).add(spec)
        spec = ModelSpec(
            "m", ModelKind.TOLLGATE, (Target("http://h"),), tokenizer=str(BUILTIN_MODEL_DIR)
        )
        row = await ModelService(session).add(spec)
        view = model_view(row)
        assert view["tokenizer"] == str(BUILTIN_MODEL_DIR) and view["kind"] == "tollgate"
