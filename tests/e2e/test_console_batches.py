"""The console's Batches page in real headless Chromium, against the gateway under
uvicorn: a tenant's batch (sent with the openai SDK) shows its progress and counts, its
results download, an owner cancels a running one, the overview shows the batch share
of engine time, and the billing and usage pages show batch spend apart."""

from __future__ import annotations

import json

import openai
import pytest
from playwright.async_api import Browser, expect
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.dispatch.engine_client import InProcessEngineClient
from tenants.models import BATCH_ENDPOINT_PREFIX, UsageEvent
from tests.conftest import eventually
from tests.e2e.test_console import (  # noqa: F401 (fixtures)
    LAPTOP,
    OWNER,
    admins,
    browser,
    chat,
    database_url,
    micros,
    new_context,
    server,
    shot,
    sign_in,
)
from tests.support.batches import chat_lines, submit, until

pytestmark = pytest.mark.e2e


async def test_owner_follows_downloads_and_cancels_batches(
    browser: Browser,  # noqa: F811
    server: str,  # noqa: F811
    tenant_key: str,
    engine_client: InProcessEngineClient,
) -> None:
    client = openai.AsyncOpenAI(base_url=server + "/v1", api_key=tenant_key, max_retries=0)
    done = await submit(client, chat_lines(engine_client.model_name, 3))
    await until(client, done.id, "completed")
    running = await submit(client, chat_lines(engine_client.model_name, 400, max_tokens=32))

    context = await new_context(browser, server, LAPTOP)
    page = await context.new_page()
    page.on("dialog", lambda dialog: dialog.accept())
    await sign_in(page, OWNER)
    await expect(page.locator("#batch-share")).to_contain_text("% of the tokens computed")
    engine_share = await page.locator("#batch-engine-share").inner_text()
    assert "s the engine spent stepping since it started went to batch rows" in engine_share
    assert float(engine_share.split("%")[0]) > 0  # the completed batch's steps
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
    cancelled = await until(client, running.id, "cancelled")
    assert cancelled.request_counts.completed < 400
    await page.reload()
    await expect(other.locator(".batch-status")).to_have_text("cancelled")
    await expect(other.get_by_role("button")).to_have_count(0)
    await context.close()


async def ledger_sums(
    sessions: async_sessionmaker[AsyncSession], batch: bool
) -> tuple[int, int, int]:
    """What the ledger holds for the batch rows (or the others): (rows, output tokens, cost)."""
    is_batch = UsageEvent.endpoint.startswith(BATCH_ENDPOINT_PREFIX)
    query = select(
        func.count(),
        func.coalesce(func.sum(UsageEvent.completion_tokens), 0),
        func.coalesce(func.sum(UsageEvent.cost_micros), 0),
    ).where(is_batch if batch else ~is_batch)
    async with sessions() as session:
        rows, output, cost = (await session.execute(query)).one()
    return int(rows), int(output), int(cost)


async def test_billing_and_usage_pages_show_batch_spend_apart(
    browser: Browser,  # noqa: F811
    server: str,  # noqa: F811
    sessions: async_sessionmaker[AsyncSession],
    tenant_key: str,
    engine_client: InProcessEngineClient,
) -> None:
    client = openai.AsyncOpenAI(base_url=server + "/v1", api_key=tenant_key, max_retries=0)
    done = await submit(client, chat_lines(engine_client.model_name, 3))
    await until(client, done.id, "completed")
    await chat(server, tenant_key, engine_client.model_name)
    await eventually(lambda: _all_written(sessions))
    batch = await ledger_sums(sessions, batch=True)
    interactive = await ledger_sums(sessions, batch=False)
    assert batch[0] == 3 and batch[2] > 0 and interactive[0] == 1

    context = await new_context(browser, server, LAPTOP)
    page = await context.new_page()
    await sign_in(page, OWNER)
    for path in ("/admin/billing?tenant=acme", "/admin/usage?tenant=acme"):
        await page.goto(path)
        for kind, (rows, output, cost) in (("batch", batch), ("interactive", interactive)):
            row = page.locator(f'#spend-apart tr[data-kind="{kind}"]')
            await expect(row.locator(".requests")).to_have_text(str(rows))
            await expect(row.locator(".output")).to_have_text(str(output))
            assert micros(await row.locator(".spend").inner_text()) == cost, (path, kind)
    await shot(page, "usage-batch-apart")
    await context.close()


async def _all_written(sessions: async_sessionmaker[AsyncSession]) -> bool:
    """The batch's 3 lines and the interactive request are in the ledger."""
    async with sessions() as session:
        return await session.scalar(select(func.count()).select_from(UsageEvent)) == 4
