"""The console's Adapters page in real headless Chromium, against the gateway under
uvicorn: from a tenant's page to its LoRA adapters (another tenant's not listed), every
tenant's on the page itself, and an owner removes one (audited); a viewer sees no
buttons."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from playwright.async_api import Browser, expect
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from tenants import audit
from tenants.adapters import AdapterService
from tenants.services import TenantService
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


def _folder(root: Path, rank: int) -> Path:
    """A PEFT folder as adding checks it (the engine reads the weights when used)."""
    root.mkdir()
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 16, "target_modules": ["q_proj"]}
    (root / "adapter_config.json").write_text(json.dumps(config))
    (root / "adapter_model.safetensors").write_bytes(b"\x02" + bytes(7) + b"{}")  # no tensors
    return root


@pytest.fixture
async def adapters(sessions: async_sessionmaker[AsyncSession], tmp_path: Path) -> None:
    async with sessions.begin() as session:
        for tenant in ("acme", "globex"):
            await TenantService(session).create(tenant)
        service = AdapterService(session)
        await service.add("acme-support", "tollgate-tiny", str(_folder(tmp_path / "a", 8)), "acme")
        await service.add("acme-legal", "tollgate-tiny", str(_folder(tmp_path / "b", 4)), "acme")
        await service.add("globex-ft", "tollgate-tiny", str(_folder(tmp_path / "c", 2)), "globex")


async def test_a_tenants_adapters_and_an_owner_removes_one(
    browser: Browser,  # noqa: F811
    server: str,  # noqa: F811
    adapters: None,
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    context = await new_context(browser, server, LAPTOP)
    page = await context.new_page()
    page.on("dialog", lambda dialog: dialog.accept())
    await sign_in(page, OWNER)
    await page.goto("/admin/tenants/acme")
    await page.get_by_role("link", name="LoRA adapters of acme").click()
    await expect(page.get_by_role("heading", name="Adapters of acme")).to_be_visible()
    table = page.locator("#adapters-table")
    await expect(table.locator("caption")).to_contain_text("2 adapters of acme")
    row = table.locator('tr[data-adapter="acme-support"]')
    await expect(row).to_contain_text("tollgate-tiny")
    await expect(row).to_contain_text("q_proj")
    await expect(table.locator('tr[data-adapter="globex-ft"]')).to_have_count(0)
    await shot(page, "adapters")
    await page.set_viewport_size({"width": PHONE["width"], "height": PHONE["height"]})
    assert await page.evaluate(TOO_WIDE) == []
    await page.set_viewport_size({"width": LAPTOP["width"], "height": LAPTOP["height"]})

    await page.get_by_role("link", name="Adapters", exact=True).click()
    await expect(table.locator("caption")).to_contain_text("3 adapters")
    await row.get_by_role("button", name="Remove acme-support").click()
    await expect(page.get_by_role("status")).to_contain_text("Removed acme-support")
    await expect(row).to_have_count(0)
    async with sessions() as session:
        events = await audit.list_events(session)
    assert next(e.action for e in events if e.action.startswith("adapter.")) == "adapter.remove"

    viewer = await (await new_context(browser, server, LAPTOP)).new_page()
    await sign_in(viewer, VIEWER)
    await viewer.goto("/admin/adapters")
    await expect(viewer.locator('#adapters-table tr[data-adapter="acme-legal"]')).to_be_visible()
    await expect(viewer.get_by_role("button", name="Remove acme-legal")).to_have_count(0)
