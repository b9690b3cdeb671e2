"""The console's Capacity page in real headless Chromium, against the gateway under
uvicorn with the built-in engine: the live replica's KV pool as the engine reports it, and
the what-if form whose figures are checked here against the seeds' formulas."""

from __future__ import annotations

import math
import re

import pytest
from litestar import Litestar
from playwright.async_api import Browser, expect

from backend.capacity.model import GIB
from tests.e2e.test_console import (  # noqa: F401 (fixtures)
    LAPTOP,
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

A100_80GB = {"memory": 80 * GIB, "bandwidth": 2.039e12}
LLAMA_2_7B = {"params": 6_738_415_616, "kv_per_token": 2 * 32 * 32 * 128 * 2}  # fp16


async def test_capacity_page_shows_live_replicas_and_plans_what_ifs(
    browser: Browser,  # noqa: F811
    server: str,  # noqa: F811
    live_server: tuple[Litestar, str],
) -> None:
    engine = live_server[0].state.runtime.engine.engine.engine
    context = await new_context(browser, server, LAPTOP)
    page = await context.new_page()
    await sign_in(page, VIEWER)  # reading capacity needs no write access
    await page.get_by_role("link", name="Capacity").click()
    await expect(page.get_by_role("heading", name="Capacity", exact=True)).to_be_visible()

    # The live replica: what its engine reports, and the sequences of its full context
    # the pool holds.
    stats = engine.stats()
    per_seq = math.ceil(engine.max_model_len / stats.block_size)
    row = page.locator('#replica-capacity tr[data-replica="in-process"]')
    await expect(row).to_contain_text(engine.model_dir.name)
    await expect(row.locator(".used")).to_contain_text(f"of {stats.kv_blocks_total:,}")
    await expect(row.locator(".max-sequences")).to_have_text(
        f"{stats.kv_blocks_total // per_seq:,}"
    )
    free = stats.kv_blocks_free + stats.kv_blocks_cached
    await expect(row.locator(".headroom")).to_have_text(f"{free // per_seq:,} sequences")

    # What if: Llama-2-7B (fp16) on an A100-80GB at 4k context, 10 requests/s.
    await page.get_by_label("Model").select_option("llama-2-7b")
    await page.get_by_label("GPU", exact=True).select_option("A100-80GB")
    await page.get_by_label("Context (tokens)").fill("4096")
    await page.get_by_label("Rate (requests/s)").fill("10")
    await page.get_by_label("Output tokens").fill("100")
    await page.get_by_role("button", name="Plan").click()
    await expect(page).to_have_url(re.compile(r"model=llama-2-7b.*gpu=A100-80GB"))
    result = page.locator("#whatif-result")
    await expect(result.locator("caption")).to_contain_text("llama-2-7b on A100-80GB (fp16")
    # The seeds' formulas: KV budget = memory x 0.9 - weights; concurrency = budget /
    # (KV per token x context).
    weights = LLAMA_2_7B["params"] * 2
    budget = A100_80GB["memory"] * 0.9 - weights
    sequences = int(budget // LLAMA_2_7B["kv_per_token"]) // 4096
    max_row = result.locator('tr[data-key="max_concurrent_sequences"] .value')
    await expect(max_row).to_have_text(f"{sequences:,}")
    await expect(result.locator('tr[data-key="kv_bytes_per_token"] .value')).to_have_text(
        "512.0 KiB"
    )
    await expect(result.locator('tr[data-key="fits"]')).to_be_visible()

    # Decode tokens/s against batch: a dot per doubling up to the max batch; batch 1 at
    # the bandwidth floor, (weights + one sequence's KV) / HBM bandwidth.
    batches = [b for b in (1, 2, 4, 8, 16, 32, 64) if b < sequences] + [sequences]
    decode = page.locator("#chart-1 circle")
    await expect(decode).to_have_count(len(batches))
    floor = (weights + 4096 * LLAMA_2_7B["kv_per_token"]) / A100_80GB["bandwidth"]
    await expect(decode.first.locator("title")).to_have_text(f"batch 1: {1 / floor:,.0f} tok/s")
    concurrency = page.locator("#chart-2 circle")
    await expect(concurrency.first.locator("title")).to_have_text(
        f"context 512: {int(budget // LLAMA_2_7B['kv_per_token']) // 512:,} sequences"
    )
    await shot(page, "capacity")

    # Bad input: one line naming the field, which is marked invalid.
    await page.get_by_label("Context (tokens)").fill("-5")
    await page.get_by_role("button", name="Plan").click()
    await expect(page.get_by_role("alert")).to_have_text(
        "Context (tokens) must be positive, got -5"
    )
    await expect(page.get_by_label("Context (tokens)")).to_have_attribute("aria-invalid", "true")
    response = await page.request.get("/admin/capacity?context=-5")
    assert response.status == 400

    # Weights that do not fit say how many GPUs they need.
    await page.goto("/admin/capacity?model=llama-3-70b&gpu=A100-80GB&context=8192")
    await expect(page.get_by_role("alert")).to_contain_text("it needs --tensor-parallel 2")
    await context.close()

    phone = await new_context(browser, server, PHONE)
    small = await phone.new_page()
    await sign_in(small, VIEWER)
    await small.goto("/admin/capacity")
    await expect(small.locator("#chart-2 svg")).to_be_visible()
    assert await small.evaluate(TOO_WIDE) == []
    await shot(small, "capacity-phone")
    await phone.close()
