"""The admin console in real headless Chromium (Debian's, driven by Playwright), against
the gateway under uvicorn with the built-in engine. Screenshots of every page are written
to test-artifacts/console/ (printed at the end of the module)."""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncIterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import openai
import pytest
from litestar import Litestar
from playwright.async_api import Browser, BrowserContext, Page, async_playwright, expect
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from tenants import db
from tenants.admins import AdminService
from tenants.billing.prices import PriceService
from tenants.models import UsageEvent
from tenants.services import ApiKeyService, TenantService
from tests.conftest import eventually

pytestmark = pytest.mark.e2e

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "console"
OWNER, VIEWER, PASSWORD = "owner@example.com", "viewer@example.com", "correct horse battery"
LAPTOP = {"width": 1366, "height": 850}
PHONE = {"width": 390, "height": 844}
# Elements reaching past the right edge of the screen (inside a scroller is fine).
TOO_WIDE = """() => [...document.querySelectorAll('body *')]
  .filter((e) => !e.closest('.table-wrap') && e.getBoundingClientRect().right > innerWidth + 1)
  .map((e) => e.tagName + '.' + e.className + '#' + e.id)"""
# Every visible form control must have a label (or an aria-label).
UNLABELLED = """() => [...document.querySelectorAll('input:not([type=hidden]), select')]
  .filter((e) => e.labels.length === 0 && !e.getAttribute('aria-label'))
  .map((e) => e.name || e.id)"""


@pytest.fixture
def database_url(tmp_path: Path) -> str:
    """A migrated SQLite database per browser test (the flows are long; the services
    behind them run on PostgreSQL too in the integration tests)."""
    url = f"sqlite:///{tmp_path / 'tollgate.db'}"
    db.upgrade(url)
    return url


@pytest.fixture(scope="module")
async def browser() -> AsyncIterator[Browser]:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: run infra/scripts/ensure-browser.sh")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    async with async_playwright() as playwright:
        chromium = await playwright.chromium.launch(executable_path=CHROMIUM)
        yield chromium
        await chromium.close()
    print(f"\nconsole screenshots: {ARTIFACTS}")


@pytest.fixture
async def admins(sessions: async_sessionmaker[AsyncSession]) -> None:
    async with sessions.begin() as session:
        await AdminService(session).create(OWNER, "owner", PASSWORD)
        await AdminService(session).create(VIEWER, "viewer", PASSWORD)


@pytest.fixture
async def server(live_server: tuple[Litestar, str], admins: None) -> str:
    return live_server[1]


async def new_context(browser: Browser, base: str, viewport: dict[str, int]) -> BrowserContext:
    context = await browser.new_context(base_url=base, viewport=viewport)  # type: ignore[arg-type]
    context.set_default_timeout(10_000)
    return context


async def shot(page: Page, name: str) -> None:
    """Screenshot the page, after checking every control on it is labelled."""
    assert await page.evaluate(UNLABELLED) == [], f"unlabelled controls on {page.url}"
    await page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


async def sign_in(page: Page, email: str) -> None:
    await page.goto("/admin")
    await expect(page).to_have_url(re.compile(r"/admin/login\?next=/admin$"))
    await page.get_by_label("Email").fill(email)
    await page.get_by_label("Password").fill(PASSWORD)
    await page.get_by_role("button", name="Sign in").click()
    await expect(page.get_by_role("heading", name="Overview")).to_be_visible()


def micros(text: str) -> int:
    """ "$1,234.5678" as micro-dollars."""
    return int(Decimal(text.strip().lstrip("$").replace(",", "")) * 1_000_000)


async def chat(base: str, secret: str, model: str, trace_id: str | None = None) -> Any:
    """A chat request; with `trace_id`, it joins that trace (W3C traceparent)."""
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=secret, max_retries=0)
    headers = {} if trace_id is None else {"traceparent": f"00-{trace_id}-{'1' * 16}-01"}
    try:
        return await client.chat.completions.with_raw_response.create(
            model=model,
            messages=[{"role": "user", "content": "What does json.dumps do?"}],
            max_tokens=8,
            extra_headers=headers,
        )
    finally:
        await client.close()


async def usage_row(
    sessions: async_sessionmaker[AsyncSession], request_id: str
) -> UsageEvent | None:
    async with sessions() as session:
        query = select(UsageEvent).where(UsageEvent.request_id == request_id)
        return (await session.execute(query)).scalar_one_or_none()


async def test_owner_runs_the_business_from_the_console(
    browser: Browser,
    server: str,
    sessions: async_sessionmaker[AsyncSession],
    live_server: tuple[Litestar, str],
) -> None:
    model = live_server[0].state.runtime.engine.model_name
    context = await new_context(browser, server, LAPTOP)
    page = await context.new_page()
    page.on("dialog", lambda dialog: dialog.accept())
    await page.goto("/admin/login")
    await shot(page, "login")
    await sign_in(page, OWNER)

    # Keyboard users land on the skip link first; it takes them past the navigation, and
    # the focused control is visibly outlined.
    await page.keyboard.press("Tab")
    assert await page.evaluate("document.activeElement.textContent") == "Skip to content"
    outline = await page.evaluate("getComputedStyle(document.activeElement).outlineStyle")
    assert outline == "solid"
    await page.keyboard.press("Enter")
    await expect(page.locator("main")).to_be_focused()

    # Onboard a tenant.
    await page.goto("/admin/tenants")
    await page.get_by_label("Name").fill("acme")
    await page.get_by_role("button", name="Create tenant").click()
    await expect(page.get_by_role("status")).to_contain_text("Created tenant acme")
    await expect(page).to_have_url(re.compile(r"/admin/tenants/acme$"))

    # A key: the secret is shown once, with a copy button.
    await page.get_by_label("New key name").fill("production")
    await page.get_by_role("button", name="Create key").click()
    secret = await page.get_by_label(re.compile("Secret for key")).input_value()
    assert secret.startswith("tg-")
    await page.get_by_role("button", name="Copy").click()
    await expect(page.get_by_text("Copied.")).to_be_visible()
    await shot(page, "key-created")

    # The key works with the openai client, and the request shows up in the console.
    trace_id = uuid.uuid4().hex
    first = await chat(server, secret, model, trace_id)
    request_id = first.headers["x-request-id"]
    await eventually(lambda: usage_row(sessions, request_id))
    await page.goto("/admin/usage?tenant=acme")
    row = page.locator("#usage-table tbody tr", has_text=request_id)
    await expect(row).to_contain_text("completed")
    await shot(page, "usage")
    await page.get_by_role("link", name=request_id).click()
    await expect(page.get_by_role("heading", name=request_id)).to_be_visible()
    await expect(page.locator("dl")).to_contain_text("Time to first token")
    await expect(page.locator("dl")).to_contain_text("chat")
    await expect(page.locator("#trace-id")).to_have_text(trace_id)  # the trace it joined
    await expect(page.locator("dl")).to_contain_text("in-process")  # the replica
    await shot(page, "request-detail")
    csv = await page.request.get(f"/admin/usage.csv?tenant=acme&key={secret[:11]}")
    assert csv.status == 200 and request_id in await csv.text()

    await page.goto("/admin")
    await expect(page.locator("#latency tbody")).to_contain_text("chat")
    await expect(page.locator("#outcomes")).to_contain_text("completed")
    await expect(page.locator("#chart-requests polyline")).to_have_count(1)
    nonzero = re.compile(r"^[0-9.]*[1-9]")  # the request is in the charted rate
    await expect(page.locator("#chart-requests")).to_have_attribute("data-total", nonzero)
    await expect(page.locator("#chart-ttft")).to_contain_text("chat p95")
    await expect(page.locator("#replicas tbody")).to_contain_text("in-process")
    refreshes = int(await page.locator("#overview").get_attribute("data-refreshes") or 0)
    await expect(page.locator("#overview")).not_to_have_attribute(
        "data-refreshes", str(refreshes)
    )  # the charts refresh on their own
    await shot(page, "overview")

    # Revoke the key: the next call is refused.
    await page.goto("/admin/tenants/acme")
    await page.get_by_role("button", name=f"Revoke key {secret[:11]}").click()
    await expect(page.get_by_role("status")).to_contain_text(f"Revoked key {secret[:11]}")
    await expect(page.locator(f'tr[data-prefix="{secret[:11]}"]')).to_contain_text("revoked")
    await shot(page, "tenant")
    with pytest.raises(openai.AuthenticationError):
        await chat(server, secret, model)
    await page.goto("/admin")
    await expect(page.locator("#rejections")).to_contain_text("authentication: 1")

    # A new price changes what the next request costs, and so the invoice preview.
    await page.goto("/admin/billing?tenant=acme")
    before = micros(await page.locator("#invoice-total").inner_text())
    assert before > 0
    await page.goto("/admin/prices")
    await page.get_by_label("Model", exact=True).fill(model)
    await page.get_by_label("Input $ / M tokens", exact=True).fill("30")
    await page.get_by_label("Cached input $ / M tokens").fill("15")
    await page.get_by_label("Output $ / M tokens").fill("120")
    await page.get_by_role("button", name="Add price version").click()
    await expect(page.get_by_role("status")).to_contain_text(f"New price for {model}")
    await expect(page.locator("#price-table")).to_contain_text("in force")
    await shot(page, "prices")
    await page.goto("/admin/tenants/acme")
    await page.get_by_role("button", name="Create key").click()
    second_key = await page.get_by_label(re.compile("Secret for key")).input_value()
    second = await chat(server, second_key, model)
    await eventually(lambda: usage_row(sessions, second.headers["x-request-id"]))
    row_after = await usage_row(sessions, second.headers["x-request-id"])
    assert row_after is not None
    async with sessions() as session:
        (version,) = await PriceService(session).list(model)
    assert row_after.price_version_id == version.id
    expected = -(
        -(
            (row_after.prompt_tokens - row_after.cached_tokens) * 30_000_000
            + row_after.cached_tokens * 15_000_000
            + row_after.completion_tokens * 120_000_000
        )
        // 1_000_000
    )
    await page.goto("/admin/billing?tenant=acme")
    assert micros(await page.locator("#invoice-total").inner_text()) == before + expected
    await expect(page.locator("#export-status")).to_contain_text("pending")
    waiting = page.locator("#waiting-rows tr", has_text=request_id)
    await expect(waiting).to_contain_text("pending")
    await shot(page, "billing")
    report = await page.request.get("/admin/billing.csv?tenant=acme")
    assert report.status == 200 and f",{model}," in await report.text()

    # Plans and keys pages.
    await page.goto("/admin/plans")
    await page.get_by_label("Name").fill("gold")
    await page.locator("#new-rpm").fill("600")
    await page.locator("#new-budget").fill("250")
    await page.get_by_role("button", name="Create plan").click()
    await expect(page.get_by_role("status")).to_contain_text("Created plan gold")
    await shot(page, "plans")
    await page.goto("/admin/keys")
    await expect(page.locator("table.keys")).to_contain_text("revoked")
    await shot(page, "keys")

    # Owners add administrators.
    await page.goto("/admin/admins")
    await page.get_by_label("Email").fill("ops@example.com")
    await page.get_by_label("Role").select_option("viewer")
    await page.get_by_label("Initial password").fill("another long password")
    await page.get_by_role("button", name="Add administrator").click()
    await expect(page.get_by_role("status")).to_contain_text("Added viewer ops@example.com")
    await shot(page, "admins")

    # The audit trail names the administrator, and the chain verifies.
    await page.goto("/admin/audit")
    await expect(page.locator("#audit-table")).to_contain_text("key.revoke")
    await expect(page.locator("#audit-table")).to_contain_text(f"console:{OWNER}")
    for action in ("usage.export", "billing.report.export", "price.create", "console_admin.create"):
        await expect(page.locator("#audit-table")).to_contain_text(action)
    await page.get_by_role("button", name="Verify chain").click()
    await expect(page.get_by_role("status")).to_contain_text("chain intact")
    await shot(page, "audit")

    # A forged post (no CSRF token) from this signed-in browser is refused.
    forged = await page.request.post("/admin/tenants", form={"name": "forged"})
    assert forged.status == 403
    await page.goto("/admin/tenants?q=forged")
    await expect(page.locator("table caption")).to_contain_text("0 tenants")
    await shot(page, "tenants")

    # Usable on a phone: nothing wider than the screen.
    phone = await context.new_page()
    await phone.set_viewport_size(PHONE)  # type: ignore[arg-type]
    for path, name in (("/admin", "phone-overview"), ("/admin/tenants/acme", "phone-tenant")):
        await phone.goto(path)
        fits = await phone.evaluate("document.documentElement.scrollWidth <= innerWidth")
        assert fits, (path, await phone.evaluate(TOO_WIDE))
        await shot(phone, name)

    await page.get_by_role("button", name="Sign out").click()
    await expect(page).to_have_url(re.compile(r"/admin/login$"))
    await page.goto("/admin/tenants")
    await expect(page).to_have_url(re.compile(r"/admin/login\?next=/admin/tenants$"))
    await context.close()


async def test_viewer_cannot_change_anything(
    browser: Browser, server: str, sessions: async_sessionmaker[AsyncSession]
) -> None:
    async with sessions.begin() as session:  # a key, so the keys page has revoke buttons to hide
        await ApiKeyService(session).create(await TenantService(session).create("viewed"))
    context = await new_context(browser, server, LAPTOP)
    page = await context.new_page()
    await sign_in(page, VIEWER)
    await page.goto("/admin/tenants")
    assert await page.get_by_role("button", name="Create tenant").count() == 0
    await shot(page, "viewer-tenants")
    for path in ("/admin/plans", "/admin/prices", "/admin/keys", "/admin/admins"):
        await page.goto(path)
        forms = page.locator('form[method="post"]:not([action="/admin/logout"])')
        assert await forms.count() == 0, path

    # The server refuses too, even with the session's own CSRF token.
    logout = page.locator('form[action="/admin/logout"]')
    token = await logout.locator('input[name="csrf_token"]').input_value()
    attempts = {
        "/admin/tenants": {"name": "viewer-made"},
        "/admin/plans": {"name": "viewer-plan"},
        "/admin/admins": {"email": "x@example.com", "role": "owner", "password": "p" * 12},
        "/admin/prices": {"model": "*", "input": "0", "cached_input": "0", "output": "0"},
    }
    for path, form in attempts.items():
        response = await page.request.post(path, form={**form, "csrf_token": token})
        assert response.status == 403, path
    await page.goto("/admin/tenants")
    await expect(page.locator("table caption")).to_contain_text("1 tenant")

    # Reading is allowed: a viewer may verify the audit chain.
    await page.goto("/admin/audit")
    await page.get_by_role("button", name="Verify chain").click()
    await expect(page.get_by_role("status")).to_contain_text("chain intact")
    await context.close()
