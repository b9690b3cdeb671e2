"""Hostile input is the client's error (4xx), never a 500: JSON nested past the decoder's
depth, dates at the calendar's edge, NUL characters (PostgreSQL text cannot hold them),
over-long forwarded addresses, and malformed bodies on the backend's internal API."""

from __future__ import annotations

import asyncio
import re
import threading
from typing import Any

import httpx
import pytest
from litestar import Litestar
from litestar.testing import AsyncTestClient
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from backend import AsyncEngine, EngineConfig
from backend.builtin import BUILTIN_MODEL_DIR
from backend.server import create_backend_app
from backend.wire import SECRET_HEADER
from gateway.dispatch.engine_client import InProcessEngineClient
from tenants import audit
from tenants.admins import AdminService
from tenants.models import KeyRole
from tenants.services import ApiKeyService, TenantService
from tests.conftest import eventually

Client = AsyncTestClient[Litestar]
Sessions = async_sessionmaker[AsyncSession]
EDGE_OF_TIME = "9999-12-31T23:59:59-14:00"  # valid ISO 8601, but past datetime.max in UTC
CSRF = re.compile(r'name="csrf_token" value="([^"]+)"')


@pytest.fixture
async def admin(sessions: Sessions) -> dict[str, str]:
    async with sessions.begin() as session:
        tenant = await TenantService(session).create("ops")
        key = await ApiKeyService(session).create(tenant, "root", KeyRole.ADMIN)
    return {"Authorization": f"Bearer {key.secret}"}


@pytest.fixture
def tenant(tenant_key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {tenant_key}"}


def nested(depth: int) -> bytes:
    return b'{"a":' * depth + b"1" + b"}" * depth


def on_postgres(database_url: str) -> bool:
    return database_url.startswith("postgresql")


@pytest.mark.parametrize("path", ["/admin/api/tenants", "/admin/api/prices"])
async def test_json_nested_too_deep_is_a_400(
    client: Client, admin: dict[str, str], path: str
) -> None:
    answer = await client.post(path, content=nested(1000), headers=admin)
    assert answer.status_code == 400
    assert answer.json()["error"]["type"] == "invalid_request_error"
    assert (await client.get("/admin/api/tenants", headers=admin)).status_code == 200


async def test_chat_json_nested_too_deep_is_a_400(client: Client, tenant: dict[str, str]) -> None:
    answer = await client.post("/v1/chat/completions", content=nested(1000), headers=tenant)
    assert answer.status_code == 400


@pytest.mark.parametrize("period", ["0000-01", "9999-12"])
async def test_periods_outside_the_calendar_are_a_400(
    client: Client, tenant: dict[str, str], period: str
) -> None:
    answer = await client.get("/v1/usage", params={"period": period}, headers=tenant)
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "period"


async def test_times_past_the_calendar_in_utc_are_a_400(
    client: Client, admin: dict[str, str]
) -> None:
    listed = await client.get("/admin/api/audit", params={"since": EDGE_OF_TIME}, headers=admin)
    price = {
        "model": "m",
        "input_micros_per_mtok": 1,
        "cached_input_micros_per_mtok": 1,
        "output_micros_per_mtok": 1,
        "effective_from": EDGE_OF_TIME,
    }
    created = await client.post("/admin/api/prices", json=price, headers=admin)
    assert (listed.status_code, created.status_code) == (400, 400)
    assert created.json()["error"]["param"] == "effective_from"


async def test_nul_in_a_request_id_is_not_found(client: Client, tenant: dict[str, str]) -> None:
    answer = await client.get("/v1/usage/requests/req%00x", headers=tenant)
    assert answer.status_code == 404


async def test_nul_in_stored_text_is_a_400_where_the_database_cannot_hold_it(
    client: Client, admin: dict[str, str], database_url: str
) -> None:
    price = {
        "model": "m\u0000",
        "input_micros_per_mtok": 1,
        "cached_input_micros_per_mtok": 1,
        "output_micros_per_mtok": 1,
    }
    answer = await client.post("/admin/api/prices", json=price, headers=admin)
    assert answer.status_code == (400 if on_postgres(database_url) else 201)
    filtered = await client.get("/admin/api/audit", params={"actor": "a\u0000"}, headers=admin)
    assert filtered.status_code == (400 if on_postgres(database_url) else 200)


async def test_nul_in_a_sign_in_email_is_a_wrong_email(client: Client) -> None:
    form = await client.get("/admin/login")
    token = CSRF.search(form.text)
    assert token is not None
    data = {"csrf_token": token.group(1), "email": "owner\u0000@localhost", "password": "x" * 12}
    answer = await client.post("/admin/login", data=data)
    assert answer.status_code == 401


async def test_a_long_forwarded_address_does_not_break_audited_actions(
    live_server: tuple[Litestar, str], admin: dict[str, str], sessions: Sessions
) -> None:
    """uvicorn believes its loopback peer's X-Forwarded-For, whatever it names."""
    async with sessions.begin() as session:
        await AdminService(session).create("owner@example.com", "owner", "correct horse battery")
    junk, address = "x" * 100, "2001:0db8:0000:0000:0000:0000:0000:0001"
    async with httpx.AsyncClient(base_url=live_server[1], follow_redirects=False) as http:
        for forwarded in (junk, address):
            created = await http.post(
                "/admin/api/tenants",
                json={"name": f"t{len(forwarded)}"},
                headers={**admin, "X-Forwarded-For": forwarded},
            )
            assert created.status_code == 201, created.text
        form = await http.get("/admin/login")
        token = CSRF.search(form.text)
        assert token is not None
        signed_in = await http.post(
            "/admin/login",
            data={
                "csrf_token": token.group(1),
                "email": "owner@example.com",
                "password": "correct horse battery",
            },
            headers={"X-Forwarded-For": junk},
        )
        assert signed_in.status_code == 303
    async with sessions() as session:
        events = await audit.list_events(session, action="tenant.create")
    forwarded_ips = sorted(e.ip or "" for e in events if e.target in ("tenant:t100", "tenant:t39"))
    assert forwarded_ips == ["2001:db8::1", "x" * 64]


@pytest.mark.parametrize("body", [b"", b"{", b'{"request_id": 5}', b"[]", nested(1000)])
async def test_bad_bodies_on_the_internal_api_are_a_400(body: bytes) -> None:
    engine = AsyncEngine.from_pretrained(BUILTIN_MODEL_DIR, EngineConfig(cpu_threads=1))
    app = create_backend_app(engine, BUILTIN_MODEL_DIR, secret="s3cret")
    headers: dict[str, Any] = {SECRET_HEADER: "s3cret"}
    async with AsyncTestClient(app=app) as backend:
        for path in ("/internal/abort", "/internal/generate"):
            answer = await backend.post(path, content=body, headers=headers)
            assert answer.status_code == 400, (path, answer.text)
        assert (await backend.get("/healthz")).status_code == 200


@pytest.mark.parametrize(
    ("path", "field", "turn"),
    [
        ("/v1/chat/completions", "messages", {"role": "user", "content": None}),
        ("/v1/chat/completions", "messages", {"role": "user", "content": ""}),
        ("/v1/responses", "input", {"role": "user", "content": ""}),
    ],
)
async def test_more_messages_than_the_context_has_tokens_are_refused_unrendered(
    live_server: tuple[Litestar, str],
    tenant: dict[str, str],
    engine_client: InProcessEngineClient,
    monkeypatch: pytest.MonkeyPatch,
    path: str,
    field: str,
    turn: dict[str, Any],
) -> None:
    """100k empty messages (3.3 MB) have no content characters, but each takes at least a
    token: refused as past the context before their template is rendered (rendering and
    tokenizing them held the event loop, /healthz included, for 1.3 s)."""
    rendered: list[int] = []
    render = engine_client.render_chat

    def recording(messages: list[dict[str, Any]], tools: Any = None) -> str:
        rendered.append(len(messages))
        return render(messages, tools)

    monkeypatch.setattr(engine_client, "render_chat", recording)
    body = {"model": engine_client.model_name, field: [turn] * 100_000}
    async with httpx.AsyncClient(base_url=live_server[1], timeout=60) as http:
        refused = await http.post(path, json=body, headers=tenant)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert (error["code"], error["param"]) == ("context_length_exceeded", field)
    assert "100000 messages" in error["message"]
    assert rendered == []


async def test_healthz_answers_while_many_empty_messages_are_rendered(
    live_server: tuple[Litestar, str],
    tenant: dict[str, str],
    engine_client: InProcessEngineClient,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Messages count towards what is long (their template's characters), so many empty
    ones are rendered and tokenized off the event loop: the rendering here waits until
    /healthz has answered, which it could not do if it ran on the loop (bounded: 10 s)."""
    healthz_answered = threading.Event()
    order: list[str] = []
    render = engine_client.render_chat

    def gated(messages: list[dict[str, Any]], tools: Any = None) -> str:
        order.append("rendering")
        healthz_answered.wait(timeout=10)
        order.append("rendered")
        return render(messages, tools)

    monkeypatch.setattr(engine_client, "render_chat", gated)
    turns = [{"role": "user", "content": None}] * 200  # no content characters at all
    body = {"model": engine_client.model_name, "messages": turns, "max_tokens": 1}
    async with httpx.AsyncClient(base_url=live_server[1], timeout=60) as http:
        chat = asyncio.create_task(http.post("/v1/chat/completions", json=body, headers=tenant))
        await eventually(lambda: order)
        health = await http.get("/healthz")
        order.append("healthz")
        healthz_answered.set()
        answer = await chat
    assert health.status_code == 200
    assert order == ["rendering", "healthz", "rendered"]
    assert answer.status_code == 200, answer.text
