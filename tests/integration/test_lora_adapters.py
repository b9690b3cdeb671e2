"""LoRA adapters as product objects (issue 34 item 3), on SQLite and PostgreSQL, through a
real server: added, listed and removed through the admin API (audited, the folder checked
against the engine's limits); a tenant reaches its own adapter by name in `model` (the
openai client's completion equals the engine's own output with that adapter) and sees it
in /v1/models with its base model as `parent`; to another tenant the name is a model that
does not exist, word for word, through every route; priced at the base model's price
unless the book prices the adapter."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from litestar import Litestar
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from backend.builtin import BUILTIN_MODEL_DIR
from backend.engine.engine import Engine
from backend.requests import EngineRequest, LoRARequest
from backend.sampling import SamplingParams
from gateway.app import create_app, engine_config
from gateway.dispatch.engine_client import InProcessEngineClient
from gateway.metering.recorder import STALE_AFTER_S
from gateway.settings import Settings
from tenants.adapters import AdapterService
from tenants.audit import AuditEvent
from tenants.billing.prices import PriceService
from tenants.models import KeyRole, UsageCheckpoint, UsageEvent, utcnow
from tenants.pricing import DEFAULT_PRICE, Price
from tenants.services import ApiKeyService, TenantService
from tests.conftest import serving
from tests.engine.engine_support import run_to_completion, text_of
from tests.engine.test_lora import ALL, build_adapter

Sessions = async_sessionmaker[AsyncSession]
PROMPT = [5, 17, 42, 99, 7, 23]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def lora_config() -> Any:
    return replace(engine_config(Settings.from_env({})), max_loras=2, max_lora_rank=8)


@pytest.fixture(scope="module")
async def lora_engine(lora_config: Any) -> AsyncIterator[InProcessEngineClient]:
    client = await InProcessEngineClient.load(BUILTIN_MODEL_DIR, lora_config)
    yield client
    await client.close()


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "r4": build_adapter(root / "r4", BUILTIN_MODEL_DIR, 4, seed=1),
        "r16": build_adapter(root / "r16", BUILTIN_MODEL_DIR, 16, seed=2),
    }


@pytest.fixture
async def gateway(
    settings: Settings, lora_engine: InProcessEngineClient, lora_config: Any
) -> AsyncIterator[tuple[Litestar, str]]:
    app = create_app(replace(settings, engine=lora_config), engine_client=lora_engine)
    async with serving(app) as url:
        yield app, url


async def _key(sessions: Sessions, tenant: str, role: KeyRole = KeyRole.TENANT) -> str:
    async with sessions.begin() as session:
        found = await TenantService(session).find(tenant)
        owner = found or await TenantService(session).create(tenant)
        return (await ApiKeyService(session).create(owner, "k", role)).secret


def _auth(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def _engine_text(config: Any, lora: LoRARequest | None) -> str:
    """The engine's own greedy output for PROMPT, with `lora` (no gateway)."""
    engine = Engine(BUILTIN_MODEL_DIR, config)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    engine.add_request(EngineRequest(PROMPT, params, "x", lora=lora))
    return text_of(run_to_completion(engine)["x"])


async def _add(
    http: httpx.AsyncClient, admin: dict[str, str], name: str, folder: Path, tenant: str, base: str
) -> httpx.Response:
    body = {"name": name, "base_model": base, "path": str(folder), "tenant": tenant}
    return await http.post("/admin/api/adapters", json=body, headers=admin)


async def test_adapters_through_the_admin_api_are_checked_and_audited(
    gateway: tuple[Litestar, str], sessions: Sessions, folders: dict[str, Path], tmp_path: Path
) -> None:
    app, url = gateway
    admin = _auth(await _key(sessions, "ops", KeyRole.ADMIN))
    await _key(sessions, "acme")
    base = app.state.runtime.directory.names()[0]
    async with httpx.AsyncClient(base_url=url) as http:
        created = await _add(http, admin, "acme-support", folders["r4"], "acme", base)
        assert created.status_code == 201, created.text
        assert created.json() | {"created_at": ""} == {
            "name": "acme-support",
            "tenant": "acme",
            "base_model": base,
            "path": str(folders["r4"]),
            "rank": 4,
            "target_modules": sorted(ALL),
            "created_at": "",
        }
        again = await _add(http, admin, "acme-support", folders["r4"], "acme", base)
        assert again.status_code == 409
        too_big = await _add(http, admin, "big", folders["r16"], "acme", base)
        assert too_big.status_code == 400
        assert "rank 16 is above the engine's max_lora_rank 8" in too_big.json()["error"]["message"]
        empty = await _add(http, admin, "empty", tmp_path, "acme", base)
        assert empty.status_code == 400 and "adapter_config.json" in empty.text
        nobody = await _add(http, admin, "x", folders["r4"], "nobody", base)
        assert nobody.status_code == 404
        tenant_key = _auth(await _key(sessions, "acme"))
        refused = await _add(http, tenant_key, "mine", folders["r4"], "acme", base)
        assert refused.status_code == 403
        listed = await http.get("/admin/api/adapters", params={"tenant": "acme"}, headers=admin)
        assert [a["name"] for a in listed.json()] == ["acme-support"]
        other = await http.get("/admin/api/adapters", params={"tenant": "ops"}, headers=admin)
        assert other.json() == []
        gone = await http.delete("/admin/api/adapters/acme-support", headers=admin)
        assert gone.status_code == 204
        assert (
            await http.delete("/admin/api/adapters/acme-support", headers=admin)
        ).status_code == 404
    async with sessions() as session:
        rows = await session.execute(
            select(AuditEvent.action, AuditEvent.actor).where(
                AuditEvent.target == "adapter:acme-support"
            )
        )
        assert [r.action for r in rows] == ["adapter.add", "adapter.remove"]


async def _error(response: httpx.Response, name: str) -> tuple[int, dict[str, Any]]:
    """Status and error body, the model's name taken out of the message."""
    error = response.json()["error"]
    return response.status_code, error | {"message": error["message"].replace(name, "NAME")}


async def test_a_tenant_reaches_its_own_adapter_and_no_other_tenant_can(
    gateway: tuple[Litestar, str],
    sessions: Sessions,
    folders: dict[str, Path],
    lora_config: Any,
) -> None:
    app, url = gateway
    admin = _auth(await _key(sessions, "ops", KeyRole.ADMIN))
    acme, globex = await _key(sessions, "acme"), await _key(sessions, "globex")
    base = app.state.runtime.directory.names()[0]
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        assert (await _add(http, admin, "acme-ft", folders["r4"], "acme", base)).status_code == 201
        await app.state.runtime.directory.refresh()  # at once, not within 2 s

        # The owner, through the openai client: the engine's own output with the adapter.
        sdk = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=acme, max_retries=0)
        extra = {"ignore_eos": True}
        own = await sdk.completions.create(
            model="acme-ft", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, extra_body=extra
        )
        on_base = await sdk.completions.create(
            model=base, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, extra_body=extra
        )
        adapted = _engine_text(lora_config, LoRARequest("acme-ft", str(folders["r4"])))
        assert own.model == "acme-ft"
        assert own.choices[0].text == adapted
        assert on_base.choices[0].text == _engine_text(lora_config, None) != adapted
        chat = await sdk.chat.completions.create(
            model="acme-ft", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert chat.model == "acme-ft"
        cards = {m.id: m for m in (await sdk.models.list()).data}
        assert cards["acme-ft"].model_extra is not None
        assert cards["acme-ft"].model_extra["parent"] == base
        assert (await sdk.models.retrieve("acme-ft")).id == "acme-ft"
        await sdk.close()

        # Another tenant: every route answers as for a model that does not exist.
        them = _auth(globex)
        listed = await http.get("/v1/models", headers=them)
        assert "acme-ft" not in {m["id"] for m in listed.json()["data"]}
        for name in ("acme-ft", "no-such-model"):
            probes = {
                "completions": await http.post(
                    "/v1/completions",
                    json={"model": name, "prompt": "x", "max_tokens": 2},
                    headers=them,
                ),
                "chat": await http.post(
                    "/v1/chat/completions",
                    json={"model": name, "messages": [{"role": "user", "content": "x"}]},
                    headers=them,
                ),
                "responses": await http.post(
                    "/v1/responses", json={"model": name, "input": "x"}, headers=them
                ),
                "embeddings": await http.post(
                    "/v1/embeddings", json={"model": name, "input": "x"}, headers=them
                ),
                "model": await http.get(f"/v1/models/{name}", headers=them),
                "batches": await _batch(http, them, name),
            }
            answers = {route: await _error(r, name) for route, r in probes.items()}
            if name == "acme-ft":
                stolen = answers
            else:
                assert stolen == answers
        assert all(status == 404 for status, _ in stolen.values())
        assert stolen["completions"][1]["code"] == "model_not_found"
        # The owner's embeddings: a clear refusal (adapters do not embed).
        embedded = await http.post(
            "/v1/embeddings", json={"model": "acme-ft", "input": "x"}, headers=_auth(acme)
        )
        assert embedded.status_code == 400
    async with sessions() as session:
        models = await session.scalars(
            select(UsageEvent.model).where(UsageEvent.status == "completed")
        )
        assert "acme-ft" in set(models)


async def _batch(http: httpx.AsyncClient, auth: dict[str, str], model: str) -> httpx.Response:
    line = {
        "custom_id": "1",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": model, "prompt": "x", "max_tokens": 2},
    }
    files = {"file": ("in.jsonl", (json.dumps(line) + "\n").encode())}
    uploaded = await http.post("/v1/files", data={"purpose": "batch"}, files=files, headers=auth)
    assert uploaded.status_code == 200, uploaded.text
    body = {
        "input_file_id": uploaded.json()["id"],
        "endpoint": "/v1/completions",
        "completion_window": "24h",
    }
    return await http.post("/v1/batches", json=body, headers=auth)


async def test_an_adapter_pays_its_base_models_price_unless_it_has_its_own(
    gateway: tuple[Litestar, str], sessions: Sessions, folders: dict[str, Path]
) -> None:
    app, url = gateway
    runtime = app.state.runtime
    admin = _auth(await _key(sessions, "ops", KeyRole.ADMIN))
    acme = _auth(await _key(sessions, "acme"))
    base = runtime.directory.names()[0]
    own = Price(7_000_000, 1_000_000, 9_000_000)
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        for name in ("ft-a", "ft-b"):
            assert (await _add(http, admin, name, folders["r4"], "acme", base)).status_code == 201
        async with sessions.begin() as session:
            await PriceService(session).create("ft-b", own, utcnow() - timedelta(seconds=1))
        runtime.recorder.prices.invalidate()
        await runtime.directory.refresh()
        for name in ("ft-a", "ft-b"):
            body = {
                "model": name,
                "prompt": PROMPT,
                "max_tokens": 4,
                "ignore_eos": True,
                "temperature": 0,
            }
            answer = await http.post("/v1/completions", json=body, headers=acme)
            assert answer.status_code == 200, answer.text
    await runtime.tasks.drain()
    async with sessions() as session:
        rows = {r.model: r for r in await session.scalars(select(UsageEvent))}
    for name, price in (("ft-a", DEFAULT_PRICE), ("ft-b", own)):
        row = rows[name]
        assert row.cost_micros == price.cost_micros(row.prompt_tokens, row.cached_tokens, 4)


async def test_names_no_stored_row_can_have_are_refused_not_queried(
    gateway: tuple[Litestar, str], sessions: Sessions, folders: dict[str, Path]
) -> None:
    """A NUL (PostgreSQL refuses it in a query) or an overlong name: 400 or 404, never 500."""
    _, url = gateway
    admin = _auth(await _key(sessions, "ops", KeyRole.ADMIN))
    async with httpx.AsyncClient(base_url=url) as http:
        for name, base, tenant, status in (
            ("ok", "m\u0000", "ops", 400),
            ("ok", "m" * 200, "ops", 400),
            ("ok", "m", "o\u0000ps", 404),
            ("ok", "m", "o" * 300, 404),
            ("x\n", "m", "ops", 400),
        ):
            body = {"name": name, "base_model": base, "path": str(folders["r4"]), "tenant": tenant}
            reply = await http.post("/admin/api/adapters", json=body, headers=admin)
            assert reply.status_code == status, (name, base, tenant, reply.text)
        listed = await http.get("/admin/api/adapters", params={"tenant": "a\u0000"}, headers=admin)
        assert listed.json() == []
        gone = await http.delete("/admin/api/adapters/a%00b", headers=admin)
        assert gone.status_code == 404


async def test_a_dead_gateways_adapter_stream_is_billed_at_its_base_models_price(
    gateway: tuple[Litestar, str], sessions: Sessions, folders: dict[str, Path]
) -> None:
    """The checkpoint names the adapter alone; the orphan's row pays the base's price."""
    app, _ = gateway
    base_price = Price(3_000_000, 1_000_000, 5_000_000)
    async with sessions.begin() as session:
        tenant = await TenantService(session).create("acme")
        key = (await ApiKeyService(session).create(tenant)).key
        await AdapterService(session).add("ft", "base-m", str(folders["r4"]), "acme")
        await PriceService(session).create("base-m", base_price, utcnow() - timedelta(seconds=200))
        session.add(
            UsageCheckpoint(
                request_id="req_orphan",
                tenant_id=tenant.id,
                api_key_id=key.id,
                model="ft",
                endpoint="completions",
                prompt_tokens=10,
                cached_tokens=0,
                completion_tokens=37,
                started_at=utcnow() - timedelta(seconds=120),
                updated_at=utcnow() - timedelta(seconds=STALE_AFTER_S + 5),
            )
        )
    recorder = app.state.runtime.recorder
    recorder.prices.invalidate()
    assert await recorder.bill_orphans() == 1
    async with sessions() as session:
        row = await session.scalar(select(UsageEvent).where(UsageEvent.request_id == "req_orphan"))
    assert row is not None and row.cost_micros == base_price.cost_micros(10, 0, 37)
