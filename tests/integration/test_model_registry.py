"""The model registry through the gateway: the admin API (audited, typed errors), what
/v1/models lists, the price check at admission, and a change reaching another replica
sharing the database within seconds."""

from __future__ import annotations

from typing import Any

import httpx
from litestar import Litestar
from litestar.testing import AsyncTestClient
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.app import create_app
from gateway.dispatch.engine_client import InProcessEngineClient
from gateway.runtime import Runtime
from gateway.settings import Settings
from tenants import audit
from tenants.billing.prices import ANY_MODEL, PriceService
from tenants.limits import PlanTerms
from tenants.models import KeyRole, utcnow
from tenants.pricing import Price
from tenants.registry import ModelKind, ModelService, ModelSpec, Target
from tenants.services import ApiKeyService, PlanService, TenantService
from tests.conftest import eventually, serving
from tests.support.vllm_like import Config
from tests.support.vllm_like import create_app as vllm_like

Sessions = async_sessionmaker[AsyncSession]
LLAMA = {
    "name": "meta-llama/Llama-3.1-8B",
    "kind": "openai",
    "targets": [{"url": "http://127.0.0.1:8001", "weight": 3}, {"url": "http://127.0.0.1:8002"}],
    "api_key_env": "TOLLGATE_UPSTREAM_KEY_VLLM",
    "context_length": 8192,
}


async def _key(sessions: Sessions, tenant: str, role: KeyRole, plan: str | None = None) -> str:
    async with sessions.begin() as session:
        created = await TenantService(session).create(tenant, plan)
        key = await ApiKeyService(session).create(created, "k", role)
    return key.secret


def _auth(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


async def _listed(client: AsyncTestClient[Any], secret: str) -> dict[str, dict[str, Any]]:
    response = await client.get("/v1/models", headers=_auth(secret))
    assert response.status_code == 200, response.text
    return {card["id"]: card for card in response.json()["data"]}


async def _refreshed(client: AsyncTestClient[Litestar]) -> None:
    """Re-read the registry now instead of waiting for the 2 s refresh."""
    runtime: Runtime = client.app.state.runtime
    assert runtime.models is not None
    await runtime.models.refresh()


async def test_models_through_the_admin_api_are_audited_with_typed_errors(
    client: AsyncTestClient[Any], sessions: Sessions
) -> None:
    admin = _auth(await _key(sessions, "ops", KeyRole.ADMIN))
    created = await client.post("/admin/api/models", json=LLAMA, headers=admin)
    assert created.status_code == 201, created.text
    assert created.json()["targets"][1] == {"url": "http://127.0.0.1:8002", "weight": 1}
    again = await client.post("/admin/api/models", json=LLAMA, headers=admin)
    assert again.status_code == 409 and "already exists" in again.json()["error"]["message"]

    path = f"/admin/api/models/{LLAMA['name']}"  # a name with '/' in it
    patched = await client.patch(path, json={"context_length": None}, headers=admin)
    assert patched.status_code == 200, patched.text
    assert patched.json()["context_length"] is None
    assert patched.json()["api_key_env"] == "TOLLGATE_UPSTREAM_KEY_VLLM"  # what was not given stays
    fetched = await client.get(path, headers=admin)
    assert fetched.json()["upstream_model"] is None
    assert [m["name"] for m in (await client.get("/admin/api/models", headers=admin)).json()] == [
        LLAMA["name"]
    ]

    bad_url = {**LLAMA, "name": "x", "targets": [{"url": "ftp://h"}]}
    refused = await client.post("/admin/api/models", json=bad_url, headers=admin)
    assert refused.status_code == 400 and "http(s)" in refused.json()["error"]["message"]
    a_secret = await client.patch(path, json={"api_key_env": "sk-live-abc"}, headers=admin)
    assert a_secret.status_code == 400 and "variable" in a_secret.json()["error"]["message"]
    assert "sk-live-abc" not in a_secret.text  # perhaps a key: never echoed
    for own in ("TOLLGATE_DATABASE_URL", "TOLLGATE_STRIPE_API_KEY", "TOLLGATE_BACKEND_SECRET"):
        leak = {**LLAMA, "name": "leak", "api_key_env": own}
        refused = await client.post("/admin/api/models", json=leak, headers=admin)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert (error["type"], error["param"]) == ("invalid_request_error", "api_key_env")
        assert "TOLLGATE_UPSTREAM_KEY_<NAME>" in error["message"]
    unknown_field = await client.patch(path, json={"name": "renamed"}, headers=admin)
    assert unknown_field.status_code == 400
    assert (await client.patch(path, json={}, headers=admin)).status_code == 400
    assert (await client.get("/admin/api/models/ghost", headers=admin)).status_code == 404

    tenant = _auth(await _key(sessions, "acme", KeyRole.TENANT))
    forbidden = await client.post("/admin/api/models", json={**LLAMA, "name": "y"}, headers=tenant)
    assert forbidden.status_code == 403

    assert (await client.delete(path, headers=admin)).status_code == 204
    assert (await client.get(path, headers=admin)).status_code == 404
    assert (await client.delete(path, headers=admin)).status_code == 404
    async with sessions() as session:
        events = await audit.list_events(session, actor=None)
    model_events = [(e.action, e.target) for e in reversed(events) if e.action.startswith("model.")]
    target = f"model:{LLAMA['name']}"
    assert model_events == [
        ("model.add", target),
        ("model.update", target),
        ("model.remove", target),
    ]
    assert all(e.actor.startswith("key:") for e in events if e.action.startswith("model."))


async def test_v1_models_lists_what_the_plan_allows_with_owner_and_context(
    client: AsyncTestClient[Any], sessions: Sessions, engine_client: InProcessEngineClient
) -> None:
    tiny = engine_client.model_name
    async with sessions.begin() as session:
        models = ModelService(session)
        await models.add(ModelSpec("up", ModelKind.OPENAI, (Target("http://127.0.0.1:1"),)))
        await models.add(
            ModelSpec("own", ModelKind.TOLLGATE, (Target("http://127.0.0.1:2"),), context_length=64)
        )
        await PlanService(session).create("narrow", PlanTerms(allowed_models=frozenset({"up"})))
    await _refreshed(client)

    everything = await _listed(client, await _key(sessions, "acme", KeyRole.TENANT))
    assert list(everything) == [tiny, "own", "up"]  # the default entry first
    assert everything[tiny]["owned_by"] == "tollgate"
    assert everything[tiny]["max_model_len"] == engine_client.max_model_len
    assert everything[tiny]["context_length"] == engine_client.max_model_len
    assert everything["up"]["owned_by"] == "upstream"
    assert everything["up"]["context_length"] is None  # unknown until its client is built
    assert (everything["own"]["owned_by"], everything["own"]["max_model_len"]) == ("tollgate", 64)

    narrow = await _key(sessions, "globex", KeyRole.TENANT, plan="narrow")
    assert list(await _listed(client, narrow)) == ["up"]
    one = await client.get("/v1/models/up", headers=_auth(narrow))
    assert one.status_code == 200 and one.json()["id"] == "up"
    hidden = await client.get("/v1/models/own", headers=_auth(narrow))
    assert hidden.status_code == 403 and hidden.json()["error"]["code"] == "model_not_allowed"
    missing = await client.get("/v1/models/ghost/model", headers=_auth(narrow))
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


async def test_a_registry_model_without_a_price_is_refused_never_served_free(
    live_server: tuple[Litestar, str], sessions: Sessions, engine_client: InProcessEngineClient
) -> None:
    """The default entry is served at the built-in price with an empty price book; a
    registry entry (here a vLLM-like upstream) is not, until the book prices it. (One
    event loop for the gateway and the upstream: `live_server`, not the test client.)"""
    app, base = live_server
    runtime: Runtime = app.state.runtime
    assert runtime.models is not None
    auth = _auth(await _key(sessions, "acme", KeyRole.TENANT))
    body = {"model": engine_client.model_name, "prompt": "The", "max_tokens": 2}
    async with httpx.AsyncClient(base_url=base) as http, serving(vllm_like(Config())) as url:
        default_entry = await http.post("/v1/completions", json=body, headers=auth)
        assert default_entry.status_code == 200, default_entry.text

        spec = ModelSpec("upstream", ModelKind.OPENAI, (Target(url),), upstream_model="vllm-like")
        async with sessions.begin() as session:
            await ModelService(session).add(spec)
        await runtime.models.refresh()
        body["model"] = "upstream"
        for path, request in (
            ("/v1/completions", body),
            ("/v1/chat/completions", _chat("upstream")),
        ):
            refused = await http.post(path, json=request, headers=auth)
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["code"] == "model_not_priced"
            assert "prices set" in refused.json()["error"]["message"]

        async with sessions.begin() as session:
            await PriceService(session).create(ANY_MODEL, Price(1, 1, 1), utcnow(), "test")
        runtime.recorder.prices.invalidate()
        priced = await http.post("/v1/completions", json=body, headers=auth)
        assert priced.status_code == 200, priced.text  # priced by '*': served upstream


def _chat(model: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def test_a_model_added_on_one_replica_is_listed_on_another_within_seconds(
    settings: Settings, sessions: Sessions, engine_client: InProcessEngineClient
) -> None:
    tenant = await _key(sessions, "acme", KeyRole.TENANT)
    admin = _auth(await _key(sessions, "ops", KeyRole.ADMIN))
    first = create_app(settings, engine_client=engine_client)
    second = create_app(settings, engine_client=engine_client)
    async with AsyncTestClient(app=first) as one, AsyncTestClient(app=second) as other:
        added = await one.post("/admin/api/models", json=LLAMA, headers=admin)
        assert added.status_code == 201, added.text

        async def listed_on_the_other() -> bool:
            return LLAMA["name"] in await _listed(other, tenant)

        await eventually(listed_on_the_other, timeout_s=5)
        change = {"context_length": 4096}
        assert (
            await one.patch(f"/admin/api/models/{LLAMA['name']}", json=change, headers=admin)
        ).is_success

        async def changed_on_the_other() -> bool:
            card = (await _listed(other, tenant)).get(str(LLAMA["name"]), {})
            return bool(card.get("context_length") == 4096)

        await eventually(changed_on_the_other, timeout_s=5)
        assert (await one.delete(f"/admin/api/models/{LLAMA['name']}", headers=admin)).is_success

        async def gone_on_the_other() -> bool:
            return LLAMA["name"] not in await _listed(other, tenant)

        await eventually(gone_on_the_other, timeout_s=5)
