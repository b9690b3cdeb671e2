"""The console's Models page in real headless Chromium, against the gateway under
uvicorn: an owner adds a model (CSRF-checked form), sees it unpriced, and removes it; a
refused form comes back with its reason; a viewer sees no forms."""

from __future__ import annotations

import re

import pytest
from playwright.async_api import Browser, expect
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from tenants import audit
from tests.e2e.test_console import (  # noqa: F401 (fixtures)
    LAPTOP,
    OWNER,
    PHONE,
    TOO_WIDE,
    VIEWER,
    admins,
    browser,
    database_url,
    new_context,
    server,
    shot,
    sign_in,
)

pytestmark = pytest.mark.e2e
NAME = "meta-llama/Llama-3.1-8B"


async def test_owner_adds_and_removes_a_model(
    browser: Browser,  # noqa: F811
    server: str,  # noqa: F811
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    context = await new_context(browser, server, LAPTOP)
    page = await context.new_page()
    page.on("dialog", lambda dialog: dialog.accept())
    await sign_in(page, OWNER)
    await page.get_by_role("link", name="Models").click()
    await expect(page.get_by_role("heading", name="Models", exact=True)).to_be_visible()
    await expect(page.locator("#models-table caption")).to_contain_text("0 registry models")

    await page.get_by_label("Model name", exact=True).fill(NAME)
    await page.get_by_label("Kind").select_option("openai")
    await page.get_by_label(re.compile("^Targets")).fill(
        "http://127.0.0.1:8001=3\nhttp://127.0.0.1:8002"
    )
    await page.get_by_label(re.compile("^Context length")).fill("8192")
    await page.get_by_label(re.compile("^API key variable")).fill("TOLLGATE_UPSTREAM_KEY_VLLM")
    await page.get_by_role("button", name="Add model").click()
    await expect(page.get_by_role("status")).to_contain_text(f"Added {NAME}")
    row = page.locator(f'#models-table tr[data-model="{NAME}"]')
    await expect(row).to_contain_text("http://127.0.0.1:8001 (3)")
    await expect(row).to_contain_text("http://127.0.0.1:8002 (1)")
    await expect(row).to_contain_text("8,192")
    await expect(row).to_contain_text("no price: refused")
    await shot(page, "models")

    # A refused form comes back with the reason, and nothing is stored.
    await page.get_by_label("Model name", exact=True).fill("bad")
    await page.get_by_label(re.compile("^Targets")).fill("ftp://nowhere")
    await page.get_by_role("button", name="Add model").click()
    await expect(page.get_by_role("alert")).to_contain_text("must be an http(s) URL")
    await expect(page.locator('#models-table tr[data-model="bad"]')).to_have_count(0)

    await page.set_viewport_size({"width": PHONE["width"], "height": PHONE["height"]})
    assert await page.evaluate(TOO_WIDE) == []
    await shot(page, "models-phone")
    await page.set_viewport_size({"width": LAPTOP["width"], "height": LAPTOP["height"]})

    await row.get_by_role("button", name=f"Remove {NAME}").click()
    await expect(page.get_by_role("status")).to_contain_text(f"Removed {NAME}")
    await expect(row).to_have_count(0)
    async with sessions() as session:
        events = await audit.list_events(session)
    actions = [(e.action, e.actor) for e in reversed(events) if e.action.startswith("model.")]
    assert [a for a, _ in actions] == ["model.add", "model.remove"]
    assert all(OWNER in actor for _, actor in actions)
    await context.close()


async def test_viewer_sees_models_but_no_forms(
    browser: Browser,  # noqa: F811
    server: str,  # noqa: F811
) -> None:
    context = await new_context(browser, server, LAPTOP)
    page = await context.new_page()
    await sign_in(page, VIEWER)
    await page.goto("/admin/models")
    await expect(page.locator("#models-table")).to_be_visible()
    forms = page.locator('form[method="post"]:not([action="/admin/logout"])')
    assert await forms.count() == 0
    token = await page.locator(
        'form[action="/admin/logout"] input[name="csrf_token"]'
    ).input_value()
    form: dict[str, str | float | bool] = {
        "name": "x",
        "kind": "openai",
        "targets": "http://h",
        "csrf_token": token,
    }
    assert (await page.request.post("/admin/models", form=form)).status == 403
    without_token: dict[str, str | float | bool] = {
        k: v for k, v in form.items() if k != "csrf_token"
    }
    assert (await page.request.post("/admin/models", form=without_token)).status == 403
    await context.close()
