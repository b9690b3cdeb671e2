"""Console sign-in, sessions, CSRF and roles, over HTTP against SQLite and PostgreSQL."""

from __future__ import annotations

import re
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
from litestar import Litestar
from litestar.testing import AsyncTestClient
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.app import create_app
from gateway.cli.bootstrap import ensure_console_owner
from gateway.console.auth import MAX_FORM_FIELDS
from gateway.console.session import MAX_FAILURES
from gateway.dispatch.engine_client import InProcessEngineClient
from gateway.settings import Settings
from tenants import audit
from tenants.admins import (
    AdminService,
    ConsoleSession,
    ScryptCost,
    needs_rehash,
    scrypt_cost_for_tests,
    verify_password,
)
from tenants.batches import BatchQueue, BatchStore, NewLine
from tenants.billing.export_lock import STATE
from tenants.billing.models import ExportState, OutboxRow, OutboxStatus
from tenants.models import Tenant, UsageEvent, utcnow
from tenants.services import ApiKeyService, PlanService, TenantService

Client = AsyncTestClient[Litestar]
OWNER, VIEWER, PASSWORD = "owner@example.com", "viewer@example.com", "correct horse battery"
CSRF = re.compile(r'name="csrf_token" value="([^"]+)"')
POST_FORMS = re.compile(r'<form method="post" action="([^"]+)"')


@pytest.fixture
def client(client: Client) -> Client:
    """The app client, showing redirects instead of following them."""
    client.follow_redirects = False
    return client


@pytest.fixture
async def admins(sessions: async_sessionmaker[AsyncSession]) -> None:
    async with sessions.begin() as session:
        await AdminService(session).create(OWNER, "owner", PASSWORD)
        await AdminService(session).create(VIEWER, "viewer", PASSWORD)


async def sign_in(client: Client, email: str, password: str = PASSWORD) -> str:
    """Sign in through the form; returns the session's CSRF token."""
    form = await client.get("/admin/login")
    match = CSRF.search(form.text)
    assert match is not None
    response = await client.post(
        "/admin/login",
        data={"csrf_token": match.group(1), "email": email, "password": password},
    )
    assert response.status_code == 303, response.text
    page = await client.get("/admin/tenants")
    token = CSRF.search(page.text)
    assert token is not None
    return token.group(1)


async def tenant_names(sessions: async_sessionmaker[AsyncSession]) -> list[str]:
    async with sessions() as session:
        return list((await session.execute(select(Tenant.name))).scalars())


@pytest.mark.parametrize("path", ["/admin", "/admin/tenants", "/admin/usage.csv"])
async def test_pages_without_a_session_redirect_to_sign_in(client: Client, path: str) -> None:
    response = await client.get(path)
    assert response.status_code == 303
    assert response.headers["location"] == f"/admin/login?next={path}"


async def test_sign_in_sets_a_hardened_session_cookie(client: Client, admins: None) -> None:
    form = await client.get("/admin/login")
    token = CSRF.search(form.text)
    assert token is not None
    response = await client.post(
        "/admin/login",
        data={"csrf_token": token.group(1), "email": OWNER, "password": PASSWORD},
    )
    assert response.status_code == 303
    assert response.headers["location"] == "/admin"
    session_cookie = next(
        c for c in response.headers.get_list("set-cookie") if c.startswith("tg_console=")
    )
    attributes = {part.strip().lower() for part in session_cookie.split(";")}
    assert {"httponly", "path=/admin", "samesite=lax"} <= attributes
    assert "secure" not in attributes  # plain http here; https requests get Secure
    assert (await client.get("/admin")).status_code == 200


async def test_wrong_password_is_refused_and_audited(
    client: Client, admins: None, sessions: async_sessionmaker[AsyncSession]
) -> None:
    form = await client.get("/admin/login")
    token = CSRF.search(form.text)
    assert token is not None
    response = await client.post(
        "/admin/login",
        data={"csrf_token": token.group(1), "email": OWNER, "password": "not the password"},
    )
    assert response.status_code == 401
    assert "Wrong email or password" in response.text
    assert (await client.get("/admin")).status_code == 303
    async with sessions() as session:
        events = await audit.list_events(session, action="console.sign_in_failed")
    assert [event.target for event in events] == [f"admin:{OWNER}"]


async def test_sign_in_without_the_form_token_is_refused(client: Client, admins: None) -> None:
    response = await client.post("/admin/login", data={"email": OWNER, "password": PASSWORD})
    assert response.status_code == 403
    assert (await client.get("/admin")).status_code == 303


async def test_sign_in_never_redirects_off_site(client: Client, admins: None) -> None:
    form = await client.get("/admin/login", params={"next": "https://evil.example/admin"})
    token = CSRF.search(form.text)
    assert token is not None
    response = await client.post(
        "/admin/login",
        data={
            "csrf_token": token.group(1),
            "email": OWNER,
            "password": PASSWORD,
            "next": "//evil.example/admin",
        },
    )
    assert response.headers["location"] == "/admin"


async def test_forged_post_without_csrf_token_is_refused(
    client: Client, admins: None, sessions: async_sessionmaker[AsyncSession]
) -> None:
    await sign_in(client, OWNER)
    forged = await client.post("/admin/tenants", data={"name": "forged"})
    wrong = await client.post("/admin/tenants", data={"name": "forged", "csrf_token": "x" * 43})
    assert (forged.status_code, wrong.status_code) == (403, 403)
    assert "forged" not in await tenant_names(sessions)


async def test_owner_creates_a_tenant_audited_as_the_administrator(
    client: Client, admins: None, sessions: async_sessionmaker[AsyncSession]
) -> None:
    csrf = await sign_in(client, OWNER)
    response = await client.post("/admin/tenants", data={"name": "acme", "csrf_token": csrf})
    assert response.status_code == 303
    assert response.headers["location"] == "/admin/tenants/acme"
    assert "Created tenant acme" in (await client.get("/admin/tenants/acme")).text
    async with sessions() as session:
        events = await audit.list_events(session, action="tenant.create")
    assert [(e.actor, e.target) for e in events] == [(f"console:{OWNER}", "tenant:acme")]
    assert events[0].ip is not None


async def test_invalid_input_comes_back_as_a_notice(
    client: Client, admins: None, sessions: async_sessionmaker[AsyncSession]
) -> None:
    csrf = await sign_in(client, OWNER)
    response = await client.post("/admin/tenants", data={"name": "Bad Name!", "csrf_token": csrf})
    assert response.status_code == 303
    page = await client.get(response.headers["location"])
    assert "tenant name must be" in page.text
    assert await tenant_names(sessions) == []


async def test_viewer_sees_no_buttons_and_cannot_change_anything(
    client: Client, admins: None, sessions: async_sessionmaker[AsyncSession]
) -> None:
    async with sessions.begin() as session:
        await TenantService(session).create("acme")
    csrf = await sign_in(client, VIEWER)
    tenants_page = (await client.get("/admin/tenants")).text
    tenant_page = (await client.get("/admin/tenants/acme")).text
    for html in (tenants_page, tenant_page, (await client.get("/admin/plans")).text):
        assert POST_FORMS.findall(html) == ["/admin/logout"]
    assert "Create key" not in tenant_page and "Set plan" not in tenant_page
    refused = [
        await client.post("/admin/tenants", data={"name": "viewer-made", "csrf_token": csrf}),
        await client.post("/admin/tenants/acme/keys", data={"csrf_token": csrf}),
        await client.post("/admin/plans", data={"name": "gold", "csrf_token": csrf}),
        await client.post("/admin/billing/requeue", data={"csrf_token": csrf}),
    ]
    assert [r.status_code for r in refused] == [403, 403, 403, 403]
    assert await tenant_names(sessions) == ["acme"]


async def test_sign_out_ends_the_session(client: Client, admins: None) -> None:
    csrf = await sign_in(client, OWNER)
    cookie = client.cookies.get("tg_console")
    response = await client.post("/admin/logout", data={"csrf_token": csrf})
    assert response.status_code == 303
    assert response.headers["location"] == "/admin/login"
    client.cookies.set("tg_console", cookie or "", path="/admin")  # a stolen copy is dead too
    assert (await client.get("/admin")).status_code == 303


async def test_idle_sessions_expire(
    sessions: async_sessionmaker[AsyncSession], admins: None
) -> None:
    idle = timedelta(minutes=30)
    start = utcnow()
    async with sessions.begin() as session:
        service = AdminService(session)
        token = await service.sign_in(await service.get(OWNER), now=start)
    async with sessions.begin() as session:
        assert await AdminService(session).resume(token, idle, start + timedelta(minutes=29))
    async with sessions.begin() as session:
        # Used at minute 29, so still alive at minute 58; then idle past the limit.
        assert await AdminService(session).resume(token, idle, start + timedelta(minutes=58))
        assert not await AdminService(session).resume(token, idle, start + timedelta(minutes=89))
    async with sessions() as session:
        assert (await session.execute(select(ConsoleSession))).first() is None


async def test_session_tokens_are_stored_hashed(
    sessions: async_sessionmaker[AsyncSession], admins: None
) -> None:
    async with sessions.begin() as session:
        service = AdminService(session)
        token = await service.sign_in(await service.get(OWNER))
    async with sessions() as session:
        stored = (await session.execute(select(ConsoleSession.token_hash))).scalar_one()
    assert stored != token and len(stored) == 64


async def test_repeated_failures_lock_the_account_for_a_while(
    client: Client, admins: None, sessions: async_sessionmaker[AsyncSession]
) -> None:
    async def attempt(password: str) -> int:
        form = await client.get("/admin/login")
        token = CSRF.search(form.text)
        assert token is not None
        data = {"csrf_token": token.group(1), "email": OWNER, "password": password}
        return (await client.post("/admin/login", data=data)).status_code

    assert [await attempt(f"guess {n}") for n in range(MAX_FAILURES)] == [401] * MAX_FAILURES
    assert await attempt(PASSWORD) == 429  # even the right password waits
    assert await sign_in_status(client, VIEWER) == 303  # other accounts are unaffected
    async with sessions() as session:
        failures = await audit.list_events(session, action="console.sign_in_failed")
    assert len(failures) == MAX_FAILURES


async def sign_in_status(client: Client, email: str) -> int:
    form = await client.get("/admin/login")
    token = CSRF.search(form.text)
    assert token is not None
    data = {"csrf_token": token.group(1), "email": email, "password": PASSWORD}
    return (await client.post("/admin/login", data=data)).status_code


async def test_unknown_emails_do_not_flood_the_audit_log(
    client: Client, admins: None, sessions: async_sessionmaker[AsyncSession]
) -> None:
    for n in range(3):
        assert await sign_in_status(client, f"nobody{n}@example.com") == 401
    async with sessions() as session:
        failures = await audit.list_events(session, action="console.sign_in_failed")
    assert [event.target for event in failures] == ["admin:unknown"]


async def test_first_start_creates_one_owner_with_a_password_shown_once(
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    first = await ensure_console_owner(sessions)
    assert first is not None and first.password is not None
    assert await ensure_console_owner(sessions) is None
    async with sessions() as session:
        admin = await AdminService(session).verify(first.email, first.password)
    assert admin is not None and admin.role == "owner"


async def record_usage(
    sessions: async_sessionmaker[AsyncSession], tenant_name: str, request_id: str, **fields: Any
) -> None:
    async with sessions.begin() as session:
        tenant = await TenantService(session).find(tenant_name) or await TenantService(
            session
        ).create(tenant_name)
        created = await ApiKeyService(session).create(tenant, "k")
        defaults: dict[str, Any] = {
            "model": "m",
            "endpoint": "chat.completions",
            "status": "completed",
            "prompt_tokens": 10,
            "completion_tokens": 5,
            "ttft_ms": 20.0,
            "e2e_ms": 60.0,
        }
        session.add(
            UsageEvent(
                request_id=request_id,
                tenant_id=tenant.id,
                api_key_id=created.key.id,
                **{**defaults, **fields},
            )
        )


async def test_usage_filters_and_csv_keep_tenants_apart(
    client: Client, admins: None, sessions: async_sessionmaker[AsyncSession]
) -> None:
    await record_usage(sessions, "acme", "req_acme")
    await record_usage(sessions, "globex", "req_globex", status="cancelled")
    await sign_in(client, VIEWER)
    page = (await client.get("/admin/usage", params={"tenant": "acme"})).text
    assert "req_acme" in page and "req_globex" not in page
    cancelled = (await client.get("/admin/usage", params={"status": "cancelled"})).text
    assert "req_globex" in cancelled and "req_acme" not in cancelled
    export = await client.get("/admin/usage.csv", params={"tenant": "globex"})
    lines = export.text.strip().splitlines()
    assert lines[0].startswith("request_id,created_at,tenant,key,model")
    assert [line.split(",")[0] for line in lines[1:]] == ["req_globex"]
    assert "attachment" in export.headers["content-disposition"]
    async with sessions() as session:
        (event,) = await audit.list_events(session, action="usage.export")
    assert event.actor == f"console:{VIEWER}" and event.details["tenant"] == "globex"
    detail = await client.get("/admin/requests/req_acme")
    assert detail.status_code == 200 and "Time to first token" in detail.text
    assert (await client.get("/admin/requests/req_none")).status_code == 404
    latest = (await client.get("/admin/requests")).text
    assert "req_acme" in latest and "req_globex" in latest


async def test_overview_reports_latency_by_class_and_the_engine(
    client: Client, admins: None, sessions: async_sessionmaker[AsyncSession]
) -> None:
    for n, ttft in enumerate([10.0, 20.0, 30.0, 40.0]):
        await record_usage(sessions, "acme", f"req_{n}", ttft_ms=ttft, e2e_ms=ttft + 40)
    await record_usage(sessions, "acme", "req_text", endpoint="completions", ttft_ms=99.0)
    await sign_in(client, VIEWER)
    data = (await client.get("/admin/overview.json")).json()
    classes = {row["class"]: row for row in data["latency"]}
    assert classes["chat"]["requests"] == 4
    assert (classes["chat"]["ttft_p50_ms"], classes["chat"]["ttft_p95_ms"]) == (20.0, 40.0)
    assert classes["chat"]["itl_p50_ms"] == 10.0  # (e2e - ttft) / (5 - 1)
    assert classes["completion"]["ttft_p50_ms"] == 99.0
    assert sum(data["requests_per_s"]) * data["bucket_s"] == 5
    assert data["outcomes"] == {"completed": 5}
    (replica,) = data["replicas"]
    assert replica["name"] == "in-process" and replica["healthy"] is True


async def test_owner_edits_a_plan_through_the_plan_service(
    client: Client, admins: None, sessions: async_sessionmaker[AsyncSession]
) -> None:
    csrf = await sign_in(client, OWNER)
    created = await client.post(
        "/admin/plans", data={"csrf_token": csrf, "name": "gold", "rpm": "60"}
    )
    assert created.status_code == 303
    edit = {"csrf_token": csrf, "rpm": "120", "monthly_budget": "25.50", "weight": "3"}
    assert (await client.post("/admin/plans/gold", data=edit)).status_code == 303
    async with sessions() as session:
        plan = await PlanService(session).get("gold")
        events = await audit.list_events(session, action="plan.update")
    assert (plan.rpm, plan.monthly_budget_micros, plan.weight) == (120, 25_500_000, 3)
    assert events[0].actor == f"console:{OWNER}"
    bad = await client.post("/admin/plans/gold", data={"csrf_token": csrf, "rpm": "-5"})
    assert "whole number" in (await client.get(bad.headers["location"])).text


async def test_a_plans_batch_token_and_file_caps_are_edited_and_kept(
    client: Client, admins: None, sessions: async_sessionmaker[AsyncSession]
) -> None:
    """The plan form sets max_batch_tokens and the stored-files cap (MiB); saving other
    fields keeps them (the form carries them), and the page shows them."""
    csrf = await sign_in(client, OWNER)
    form = {"csrf_token": csrf, "name": "gold", "max_batch_tokens": "9000", "max_file_mib": "5"}
    assert (await client.post("/admin/plans", data=form)).status_code == 303
    page = (await client.get("/admin/plans")).text
    assert 'name="max_batch_tokens"' in page and 'value="9000"' in page and "5 MiB" in page
    edit = {"csrf_token": csrf, "rpm": "7", "max_batch_tokens": "9000", "max_file_mib": "5"}
    assert (await client.post("/admin/plans/gold", data=edit)).status_code == 303
    async with sessions() as session:
        plan = await PlanService(session).get("gold")
    assert (plan.rpm, plan.max_batch_tokens, plan.max_file_bytes) == (7, 9000, 5 * 2**20)
    bad = {"csrf_token": csrf, "max_file_mib": "lots"}
    refused = await client.post("/admin/plans/gold", data=bad)
    assert "MiB" in (await client.get(refused.headers["location"])).text


async def test_a_console_batch_cancel_is_audited(
    client: Client, admins: None, sessions: async_sessionmaker[AsyncSession]
) -> None:
    async with sessions.begin() as session:
        tenant = await TenantService(session).create("acme")
        key = (await ApiKeyService(session).create(tenant)).key
        batch = await BatchStore(session, tenant.id).create(
            api_key_id=key.id,
            endpoint="/v1/chat/completions",
            input_file_id="file-x",
            completion_window="24h",
            metadata=None,
            lines=[NewLine(1, "a", {"model": "m", "messages": []})],
            enqueued_tokens=1,
            worst_case_micros=0,
        )
        # Its line under way (claimed for an hour) as it is committed: the gateway's runner
        # cannot finish the batch before the cancel.
        assert len(await BatchQueue(session).claim(batch.id, 1, timedelta(hours=1))) == 1
    csrf = await sign_in(client, OWNER)
    cancel = f"/admin/tenants/acme/batches/{batch.id}/cancel"
    assert (await client.post(cancel, data={"csrf_token": csrf})).status_code == 303
    async with sessions() as session:
        events = await audit.list_events(session, action="batch.cancel")
        status = (await BatchStore(session, tenant.id).get(batch.id)).status
    assert status == "cancelling"
    assert [(e.actor, e.target, e.tenant_id) for e in events] == [
        (f"console:{OWNER}", f"batch:{batch.id}", tenant.id)
    ]


async def test_session_cookie_is_secure_over_https(
    settings: Settings, engine_client: InProcessEngineClient, admins: None
) -> None:
    app = create_app(settings, engine_client=engine_client)
    async with AsyncTestClient(app=app, base_url="https://console.example") as https:
        form = await https.get("/admin/login")
        token = CSRF.search(form.text)
        assert token is not None
        data = {"csrf_token": token.group(1), "email": OWNER, "password": PASSWORD}
        response = await https.post("/admin/login", data=data, follow_redirects=False)
    cookies = response.headers.get_list("set-cookie")
    session_cookie = next(c for c in cookies if c.startswith("tg_console="))
    assert "secure" in {part.strip().lower() for part in session_cookie.split(";")}


async def test_owner_requeues_rows_stripe_refused(
    client: Client, admins: None, sessions: async_sessionmaker[AsyncSession]
) -> None:
    await record_usage(sessions, "acme", "req_refused")
    async with sessions.begin() as session:
        event = (await session.execute(select(UsageEvent))).scalar_one()
        session.add(
            OutboxRow(
                usage_event_id=event.id,
                tenant_id=event.tenant_id,
                value=7,
                occurred_at=utcnow(),
                status=OutboxStatus.FAILED,
                attempts=5,
                last_error="customer missing",
            )
        )
    csrf = await sign_in(client, OWNER)
    page = (await client.get("/admin/billing", params={"tenant": "acme"})).text
    assert "Requeue 1 refused row" in page and "customer missing" in page
    response = await client.post("/admin/billing/requeue", data={"csrf_token": csrf})
    assert response.status_code == 303
    async with sessions() as session:
        row = (await session.execute(select(OutboxRow))).scalar_one()
        (event_log,) = await audit.list_events(session, action="billing.export.requeue")
    assert (row.status, row.attempts) == (OutboxStatus.PENDING, 0)
    assert event_log.actor == f"console:{OWNER}"


@pytest.mark.parametrize("path", ["/admin/login", "/admin/tenants"])
async def test_oversized_forms_are_refused_before_parsing(
    client: Client, admins: None, path: str
) -> None:
    """10 MB of 2.5 M fields would stall the event loop seconds in parsing: 413 at once."""
    await sign_in(client, OWNER)
    fields = b"&".join([b"a=b"] * 2_500_000)
    headers = {"content-type": "application/x-www-form-urlencoded"}
    answer = await client.post(path, content=fields, headers=headers)
    assert answer.status_code == 413


@pytest.mark.parametrize("path", ["/admin/login", "/admin/tenants"])
async def test_forms_with_too_many_fields_are_refused(
    client: Client, admins: None, path: str
) -> None:
    csrf = await sign_in(client, OWNER)
    many = "&".join([f"csrf_token={csrf}", *("x=1" for _ in range(MAX_FORM_FIELDS))])
    headers = {"content-type": "application/x-www-form-urlencoded"}
    answer = await client.post(path, content=many.encode(), headers=headers)
    assert answer.status_code == 400
    assert "too many fields" in answer.text


async def test_sign_in_rehashes_a_password_stored_at_another_cost(
    client: Client, sessions: async_sessionmaker[AsyncSession]
) -> None:
    with scrypt_cost_for_tests(ScryptCost(n=2**10, r=8, p=1)):
        async with sessions.begin() as session:
            await AdminService(session).create(OWNER, "owner", PASSWORD)
    await sign_in(client, OWNER)
    async with sessions() as session:
        stored = (await AdminService(session).get(OWNER)).password_hash
    assert not needs_rehash(stored) and not stored.startswith("scrypt$1024$")
    assert verify_password(PASSWORD, stored)


async def test_billing_page_warns_about_the_stripe_export(
    client: Client, admins: None, sessions: async_sessionmaker[AsyncSession]
) -> None:
    await record_usage(sessions, "acme", "req_too_old")
    async with sessions.begin() as session:
        event = (await session.execute(select(UsageEvent))).scalar_one()
        session.add(
            OutboxRow(
                usage_event_id=event.id,
                tenant_id=event.tenant_id,
                value=7,
                occurred_at=utcnow() - timedelta(days=40),
                status=OutboxStatus.TOO_OLD,
            )
        )
        session.add(ExportState(name=STATE, meter_status="inactive", meter_error="reactivate it"))
    await sign_in(client, VIEWER)
    quiet = (await client.get("/admin/billing")).text
    assert 'id="export-warnings"' not in quiet  # Stripe off: nothing to warn about
    runtime = client.app.state.runtime
    runtime.settings = replace(runtime.settings, stripe_api_key="sk_test_on")
    page = (await client.get("/admin/billing")).text
    assert 'id="export-warnings"' in page
    assert "Stripe meter inactive: reactivate it" in page and "too_old_for_stripe" in page


async def test_a_refused_action_rolls_back_what_it_had_done(
    client: Client, admins: None, sessions: async_sessionmaker[AsyncSession]
) -> None:
    """A tenant on a plan that does not exist: the notice comes back and neither the tenant
    (already flushed when the plan was looked up) nor its audit row stays."""
    csrf = await sign_in(client, OWNER)
    response = await client.post(
        "/admin/tenants", data={"name": "acme", "plan": "missing", "csrf_token": csrf}
    )
    assert (response.status_code, response.headers["location"]) == (303, "/admin/tenants")
    assert "no plan named" in (await client.get(response.headers["location"])).text
    assert await tenant_names(sessions) == []
    async with sessions() as session:
        assert await audit.list_events(session, action="tenant.create") == []
