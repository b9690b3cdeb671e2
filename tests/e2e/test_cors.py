"""CORS from a real browser: a page on another loopback origin calls /v1 with fetch, as
the openai JS SDK does in a browser. A listed origin reads the answer and its
x-request-id; an unlisted one is stopped at the preflight, so its request never runs."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from litestar import Litestar, MediaType, get
from playwright.async_api import Browser, async_playwright
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.app import create_app
from gateway.dispatch.engine_client import InProcessEngineClient
from gateway.settings import Settings
from tenants import db
from tenants.models import UsageEvent
from tests.conftest import serving
from tests.e2e.test_console import CHROMIUM

pytestmark = pytest.mark.e2e

# What the page runs: the SDK's headers (the x-stainless family among them), then the
# answer's status and the headers a page may read only if they are exposed.
CALL = """async ([url, key, model]) => {
  try {
    const answer = await fetch(url + '/v1/chat/completions', {
      method: 'POST',
      headers: {'Authorization': 'Bearer ' + key, 'Content-Type': 'application/json',
                'X-Stainless-Os': 'Linux', 'X-Stainless-Retry-Count': '0',
                'X-Stainless-Package-Version': '4.0.0', 'OpenAI-Organization': 'org'},
      body: JSON.stringify({model, max_tokens: 3, messages: [{role: 'user', content: 'Hi'}]}),
    });
    const body = await answer.json();
    return {status: answer.status, requestId: answer.headers.get('x-request-id'),
            object: body.object};
  } catch (error) {
    return {blocked: String(error)};
  }
}"""


@get("/", media_type=MediaType.HTML)
async def page() -> str:
    return "<!doctype html><title>a page elsewhere</title>"


@pytest.fixture
def database_url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'cors.db'}"
    db.upgrade(url)
    return url


@pytest.fixture(scope="module")
async def browser() -> AsyncIterator[Browser]:
    async with async_playwright() as playwright:
        chromium = await playwright.chromium.launch(executable_path=CHROMIUM)
        yield chromium
        await chromium.close()


async def _rows(sessions: async_sessionmaker[AsyncSession]) -> int:
    async with sessions() as session:
        return int(await session.scalar(select(func.count()).select_from(UsageEvent)) or 0)


async def _call_from(browser: Browser, origin: str, args: list[str]) -> dict[str, Any]:
    context = await browser.new_context()
    try:
        tab = await context.new_page()
        await tab.goto(origin + "/")
        result: dict[str, Any] = await tab.evaluate(CALL, args)
        return result
    finally:
        await context.close()


async def test_a_listed_origin_calls_v1_and_an_unlisted_one_is_blocked(
    browser: Browser,
    settings: Settings,
    engine_client: InProcessEngineClient,
    tenant_key: str,
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    async with (
        serving(Litestar([page])) as allowed,
        serving(Litestar([page])) as unlisted,
        serving(
            create_app(replace(settings, cors_origins=(allowed,)), engine_client=engine_client)
        ) as gateway,
    ):
        args = [gateway, tenant_key, engine_client.model_name]
        answer = await _call_from(browser, allowed, args)
        refused = await _call_from(browser, unlisted, args)
    assert answer["status"] == 200 and answer["object"] == "chat.completion"
    assert str(answer["requestId"]).startswith("req_")
    assert "blocked" in refused
    assert await _rows(sessions) == 1  # the unlisted page's request never ran


async def test_cors_is_off_by_default_and_only_for_v1(
    settings: Settings, engine_client: InProcessEngineClient
) -> None:
    origin = "http://app.example"
    preflight = {"Origin": origin, "Access-Control-Request-Method": "POST"}
    on = create_app(replace(settings, cors_origins=("*",)), engine_client=engine_client)
    off_app = create_app(settings, engine_client=engine_client)
    async with serving(off_app) as off_url, httpx.AsyncClient(base_url=off_url) as http:
        off = await http.options("/v1/chat/completions", headers=preflight)
    assert "access-control-allow-origin" not in off.headers
    async with serving(on) as url, httpx.AsyncClient(base_url=url) as http:
        allowed = await http.options(
            "/v1/chat/completions",
            headers={
                **preflight,
                "Access-Control-Request-Headers": "authorization,x-stainless-arch",
            },
        )
        odd_header = await http.options(
            "/v1/chat/completions",
            headers={**preflight, "Access-Control-Request-Headers": "x-secret"},
        )
        admin = await http.options("/admin/api/tenants", headers=preflight)
        answer = await http.get("/v1/models", headers={"Origin": origin})
    assert allowed.status_code == 204
    assert allowed.headers["access-control-allow-origin"] == origin
    assert "POST" in allowed.headers["access-control-allow-methods"]
    assert allowed.headers["access-control-allow-headers"] == "authorization, x-stainless-arch"
    assert "access-control-allow-origin" not in odd_header.headers
    assert "access-control-allow-origin" not in admin.headers
    assert answer.headers["access-control-allow-origin"] == origin  # a 401, readable
    exposed = answer.headers["access-control-expose-headers"].split(", ")
    assert {"x-request-id", "x-ratelimit-remaining-tokens", "retry-after"} <= set(exposed)
