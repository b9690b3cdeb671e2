"""The console's Batches page in real headless Chromium, against the gateway under
uvicorn: a tenant's batch (sent with the openai SDK) shows its progress and counts, its
results download, an owner cancels a running one, and the overview shows the batch share
of engine time."""

from __future__ import annotations

import json

import openai
import pytest
from playwright.async_api import Browser, expect

from gateway.dispatch.engine_client import InProcessEngineClient
from tests.e2e.test_console import (  # noqa: F401 (fixtures)
    LAPTOP,
    OWNER,
    admins,
    browser,
    database_url,
    new_context,
    server,
    shot,
    sign_in,
)
from tests.integration.sdk.test_batches_api import _until
from tests.support.batches import chat_lines, submit

pytestmark = pytest.mark.e2e


async def test_owner_follows_downloads_and_cancels_batches(
    browser: Browser,  # noqa: F811
    server: str,  # noqa: F811
    tenant_key: str,
    engine_client: InProcessEngineClient,
) -> None:
    client = openai.AsyncOpenAI(base_url=server + "/v1", api_key=tenant_key, max_retries=0)
    done = await submit(client, chat_lines(engine_client.model_name, 3))
    await _until(client, done.id, "completed")
    running = await submit(client, chat_lines(engine_client.model_name, 400, max_tokens=32))

    context = await new_context(browser, server, LAPTOP)
    page = await context.new_page()
    page.on("dialog", lambda dialog: dialog.accept())
    await sign_in(page, OWNER)
    await expect(page.locator("#batch-share")).to_contain_text("% of the tokens computed")
    await page.goto("/admin/tenants/acme")
    await page.get_by_role("link", name="Batches").click()
    await expect(page.get_by_role("heading", name="Batches of acme")).to_be_visible()
    row = page.locator(f'#batches-table tr[data-batch="{done.id}"]')
    await expect(row.locator(".batch-status")).to_have_text("completed")
    await expect(row.locator(".batch-counts")).to_have_text("3 / 0 / 3")
    assert await row.locator("progress").get_attribute("value") == "3"
    href = await row.get_by_role("link", name="results").get_attribute("href")
    assert href is not None
    download = await page.request.get(href)
    lines = [json.loads(line) for line in (await download.text()).splitlines()]
    assert sorted(r["custom_id"] for r in lines) == ["line-0", "line-1", "line-2"]
    await shot(page, "batches")

    other = page.locator(f'#batches-table tr[data-batch="{running.id}"]')
    await other.get_by_role("button", name=f"Cancel {running.id}").click()
    await expect(page.get_by_role("status")).to_contain_text(f"Cancelling {running.id}")
    cancelled = await _until(client, running.id, "cancelled")
    assert cancelled.request_counts.completed < 400
    await page.reload()
    await expect(other.locator(".batch-status")).to_have_text("cancelled")
    await expect(other.get_by_role("button")).to_have_count(0)
    await context.close()
