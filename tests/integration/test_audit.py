"""The audit log: hash chain, tamper detection, append-only enforcement, and the admin,
CLI and security actions that must produce events."""

from __future__ import annotations

import asyncio
import getpass
import json
import uuid
from collections.abc import Iterator
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from litestar.testing import AsyncTestClient
from sqlalchemy import create_engine, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.cli import commands as cli
from gateway.cli.bootstrap import ensure_admin_key
from gateway.settings import Settings
from tenants import audit, db, keys
from tenants.audit import Actor, AuditContext, AuditEvent
from tenants.errors import InvalidInputError
from tenants.models import KeyRole
from tenants.services import ApiKeyService, TenantService
from tests.conftest import migrated_postgres

Sessions = async_sessionmaker[AsyncSession]


async def _record_many(sessions: Sessions, count: int) -> None:
    for number in range(count):
        async with sessions.begin() as session:
            await audit.record(
                session,
                actor="cli:tester",
                action="plan.update",
                target=f"plan:p{number}",
                details={"changes": {"rpm": [number, number + 1]}, "note": "é ü"},
                context=AuditContext(request_id=f"req_{number}", ip="127.0.0.1", user_agent="ua"),
            )


async def _verify(sessions: Sessions) -> audit.Verification:
    async with sessions() as session:
        return await audit.verify(session)


def _as_superuser(url: str, *statements: str) -> None:
    """Change rows the way an attacker with full database rights could: around the triggers."""
    engine = create_engine(db.sync_url(url))
    try:
        with engine.begin() as connection:
            if db.is_postgres(url):
                connection.execute(text("SET LOCAL session_replication_role = replica"))
            else:
                for trigger in ("audit_events_no_update", "audit_events_no_delete"):
                    connection.execute(text(f"DROP TRIGGER IF EXISTS {trigger}"))
            for statement in statements:
                connection.execute(text(statement))
    finally:
        engine.dispose()


async def test_an_intact_chain_verifies(sessions: Sessions) -> None:
    await _record_many(sessions, 5)
    async with sessions() as session, session.begin():  # rolled back: the event is not kept
        await audit.record(session, actor="system", action="x", target="y")
        await session.rollback()
    await _record_many(sessions, 1)
    result = await _verify(sessions)
    assert result.ok, result.describe()
    assert result.events == 6
    async with sessions() as session:
        events = await audit.list_events(session)
    assert [event.id for event in events] == [6, 5, 4, 3, 2, 1]  # no gap from the rollback
    assert events[0].hash == result.head_hash
    assert events[-1].prev_hash == audit.GENESIS_HASH
    assert result.describe().startswith("chain intact: 6 events")


async def test_an_empty_log_verifies(sessions: Sessions) -> None:
    result = await _verify(sessions)
    assert (result.ok, result.events) == (True, 0)


@pytest.mark.parametrize(
    ("tampering", "first_bad", "reason"),
    [
        ("UPDATE audit_events SET actor = 'someone-else' WHERE id = 3", 3, "hash mismatch"),
        ("UPDATE audit_events SET details = '{}' WHERE id = 2", 2, "hash mismatch"),
        ("DELETE FROM audit_events WHERE id = 3", 4, "sequence gap"),
        ("DELETE FROM audit_events WHERE id IN (2, 3)", 4, "sequence gap"),
        ("DELETE FROM audit_events WHERE id = 1", 2, "sequence gap"),
    ],
)
async def test_verify_names_the_first_edited_or_deleted_event(
    database_url: str, sessions: Sessions, tampering: str, first_bad: int, reason: str
) -> None:
    await _record_many(sessions, 5)
    assert (await _verify(sessions)).ok
    _as_superuser(database_url, tampering)
    result = await _verify(sessions)
    assert not result.ok
    assert result.first_bad_id == first_bad
    assert result.reason is not None and result.reason.startswith(reason)
    assert f"event {first_bad}" in result.describe()


async def test_an_anchor_catches_deletion_of_the_newest_events(
    database_url: str, sessions: Sessions
) -> None:
    await _record_many(sessions, 5)
    anchor = (await _verify(sessions)).anchor
    assert anchor is not None and anchor.id == 5
    assert audit.Anchor.parse(str(anchor)) == anchor
    await _record_many(sessions, 1)
    assert (await _verify(sessions)).ok  # the chain grew past the anchor: fine
    _as_superuser(database_url, "DELETE FROM audit_events WHERE id >= 4")
    assert (await _verify(sessions)).ok  # the chain alone cannot tell
    result = await _verify_with(sessions, anchor)
    assert (result.ok, result.first_bad_id) == (False, 4)
    assert result.reason is not None and "newest were deleted" in result.reason


async def test_an_anchor_catches_a_rewritten_chain(database_url: str, sessions: Sessions) -> None:
    await _record_many(sessions, 3)
    anchor = (await _verify(sessions)).anchor
    assert anchor is not None
    _as_superuser(database_url, "DELETE FROM audit_events")
    await _record_many(sessions, 4)  # a whole new, self-consistent chain
    assert (await _verify(sessions)).ok
    result = await _verify_with(sessions, anchor)
    assert (result.ok, result.first_bad_id) == (False, 3)
    with pytest.raises(InvalidInputError):
        audit.Anchor.parse("3:not-a-hash")


async def _verify_with(sessions: Sessions, anchor: audit.Anchor) -> audit.Verification:
    async with sessions() as session:
        return await audit.verify(session, anchor)


async def test_verify_catches_a_superuser_who_disables_the_triggers(postgres_url: str) -> None:
    engine = db.create_engine(postgres_url)
    try:
        sessions = db.session_factory(engine)
        await _record_many(sessions, 4)
        owner = create_engine(db.sync_url(postgres_url))
        with owner.begin() as connection:
            connection.execute(text("ALTER TABLE audit_events DISABLE TRIGGER USER"))
            connection.execute(text("UPDATE audit_events SET ip = '10.6.6.6' WHERE id = 2"))
            connection.execute(text("ALTER TABLE audit_events ENABLE TRIGGER USER"))
        owner.dispose()
        result = await _verify(sessions)
        assert (result.ok, result.first_bad_id) == (False, 2)
    finally:
        await engine.dispose()


async def test_verify_detects_reordering(database_url: str, sessions: Sessions) -> None:
    await _record_many(sessions, 5)
    _as_superuser(
        database_url,
        "UPDATE audit_events SET id = 1000 WHERE id = 2",
        "UPDATE audit_events SET id = 2 WHERE id = 3",
        "UPDATE audit_events SET id = 3 WHERE id = 1000",
    )
    result = await _verify(sessions)
    assert (result.ok, result.first_bad_id) == (False, 2)


async def test_a_rehashed_edit_breaks_the_next_link(database_url: str, sessions: Sessions) -> None:
    """An attacker who edits an event and recomputes its hash still breaks its successor."""
    await _record_many(sessions, 4)
    async with sessions() as session:
        event = await session.get(AuditEvent, 2)
        assert event is not None
        event.actor = "someone-else"
        forged = audit.event_hash(event)
        await session.rollback()
    _as_superuser(
        database_url,
        f"UPDATE audit_events SET actor = 'someone-else', hash = '{forged}' WHERE id = 2",
    )
    result = await _verify(sessions)
    assert (result.first_bad_id, result.reason is not None) == (3, True)
    assert result.reason is not None and result.reason.startswith("broken link")


async def test_triggers_reject_update_delete_and_truncate(
    database_url: str, sessions: Sessions
) -> None:
    await _record_many(sessions, 2)
    statements = ["UPDATE audit_events SET actor = 'x'", "DELETE FROM audit_events"]
    if db.is_postgres(database_url):
        statements.append("TRUNCATE audit_events")
    engine = create_engine(db.sync_url(database_url))
    try:
        for statement in statements:
            with pytest.raises(DBAPIError, match="append-only"), engine.begin() as connection:
                connection.execute(text(statement))
    finally:
        engine.dispose()
    assert (await _verify(sessions)).events == 2


async def test_concurrent_appends_never_fork_the_chain(sessions: Sessions) -> None:
    async def append(number: int) -> None:
        async with sessions.begin() as session:
            await audit.record(session, actor="system", action="test", target=f"t{number}")

    await asyncio.gather(*(append(number) for number in range(40)))
    result = await _verify(sessions)
    assert (result.ok, result.events) == (True, 40), result.describe()


# PostgreSQL roles: the application role may append and read, nothing more.


@pytest.fixture
def postgres_url() -> str:
    return migrated_postgres()


@pytest.fixture
def app_role(postgres_url: str) -> Iterator[str]:
    """A LOGIN role for the gateway; roles are cluster-wide, so unique and dropped after."""
    role = f"tollgate_app_{uuid.uuid4().hex[:12]}"
    admin = create_engine(db.sync_url(postgres_url), isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(text(f"CREATE ROLE {role} LOGIN PASSWORD 'app'"))
    try:
        yield role
    finally:
        with admin.connect() as connection:
            connection.execute(text(f"DROP OWNED BY {role}"))
            connection.execute(text(f"DROP ROLE {role}"))
        admin.dispose()


async def test_the_app_role_can_append_but_not_alter(
    postgres_url: str,
    app_role: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("TOLLGATE_DATABASE_URL", postgres_url)
    assert await asyncio.to_thread(cli.main, ["db", "grant-app-role", "--role", app_role]) == 0
    assert f'REVOKE UPDATE, DELETE, TRUNCATE ON "public".audit_events FROM "{app_role}"' in (
        capsys.readouterr().out
    )
    as_app = db.sync_url(postgres_url).set(username=app_role, password="app")
    app_url = as_app.render_as_string(hide_password=False)

    engine = db.create_engine(app_url)
    try:
        sessions = db.session_factory(engine)
        async with sessions.begin() as session:  # the gateway's own path works
            tenant = await TenantService(session).create("acme")
            await ApiKeyService(session).create(tenant, "ci")
        assert (await _verify(sessions)).events == 2
    finally:
        await engine.dispose()

    sync_engine = create_engine(as_app)
    try:
        for statement in (
            "UPDATE audit_events SET actor = 'x'",
            "DELETE FROM audit_events",
            "TRUNCATE audit_events",
            "ALTER TABLE audit_events DISABLE TRIGGER ALL",
            "DROP TRIGGER audit_events_no_change ON audit_events",
            "CREATE OR REPLACE FUNCTION audit_events_append_only() RETURNS trigger "
            "LANGUAGE plpgsql AS $$ BEGIN RETURN NEW; END $$",
            "SET session_replication_role = replica",
        ):
            with pytest.raises(DBAPIError) as raised, sync_engine.begin() as connection:
                connection.execute(text(statement))
            assert "permission denied" in str(raised.value) or "must be owner" in str(raised.value)
    finally:
        sync_engine.dispose()


def test_grant_app_role_needs_postgres_and_an_existing_role(database_url: str) -> None:
    missing = f"nobody_{uuid.uuid4().hex[:8]}"
    expected = "no role" if db.is_postgres(database_url) else "need PostgreSQL"
    with pytest.raises(InvalidInputError, match=expected):
        audit.grant_app_role(database_url, missing)


# The actions that must be audited.


async def _admin(sessions: Sessions) -> tuple[dict[str, str], str]:
    async with sessions.begin() as session:
        tenant = await TenantService(session).create("ops")
        created = await ApiKeyService(session).create(tenant, "root", KeyRole.ADMIN)
    return {"Authorization": f"Bearer {created.secret}"}, created.key.prefix


async def _events(client: AsyncTestClient[Any], admin: dict[str, str], **query: Any) -> Any:
    response = await client.get("/admin/api/audit", params=query, headers=admin)
    assert response.status_code == 200, response.text
    return response.json()


async def test_admin_api_changes_are_audited(
    client: AsyncTestClient[Any], sessions: Sessions
) -> None:
    admin, prefix = await _admin(sessions)
    request = {**admin, "X-Request-Id": "req-from-proxy-1", "User-Agent": "console/1.0"}
    calls = [
        ("POST", "/admin/api/plans", {"name": "gold", "rpm": 60}),
        ("PATCH", "/admin/api/plans/gold", {"rpm": 120}),
        ("POST", "/admin/api/tenants", {"name": "globex"}),
        ("PATCH", "/admin/api/tenants/globex", {"plan": "gold"}),
        ("POST", "/admin/api/tenants/globex/keys", {"name": "ci"}),
    ]
    for method, path, body in calls:
        response = await client.request(method, path, json=body, headers=request)
        assert response.is_success, response.text
        assert response.headers["x-request-id"] == "req-from-proxy-1"
    secret, key_prefix = response.json()["key"], response.json()["prefix"]
    limits = await client.patch(
        f"/admin/api/keys/{key_prefix}/limits", json={"tpm": 1000}, headers=request
    )
    assert limits.is_success
    assert (await client.post(f"/admin/api/keys/{key_prefix}/revoke", headers=request)).is_success

    page = await _events(client, admin, actor=f"key:{prefix}")
    assert [event["action"] for event in page["data"]] == [
        "key.revoke",
        "key.set_limits",
        "key.create",
        "tenant.set_plan",
        "tenant.create",
        "plan.update",
        "plan.create",
    ]
    for event in page["data"]:
        assert (event["request_id"], event["user_agent"]) == ("req-from-proxy-1", "console/1.0")
        assert event["ip"] is not None
    by_action = {event["action"]: event for event in page["data"]}
    assert by_action["plan.update"]["details"] == {"changes": {"rpm": [60, 120]}}
    assert by_action["tenant.set_plan"]["details"] == {"plan": [None, "gold"]}
    assert by_action["key.set_limits"]["details"] == {"changes": {"tpm": [None, 1000]}}
    assert by_action["key.create"]["target"] == f"key:{key_prefix}"
    assert by_action["key.create"]["tenant_id"] == by_action["tenant.create"]["tenant_id"]
    assert secret not in json.dumps(page)  # the secret is never in the log
    assert secret.split("_", 1)[1] not in json.dumps(page)

    globex = await _events(client, admin, tenant="globex")
    assert {event["action"] for event in globex["data"]} == {
        "tenant.create",
        "tenant.set_plan",
        "key.create",
        "key.set_limits",
        "key.revoke",
    }
    verified = await client.post("/admin/api/audit/verify", headers=admin)
    assert verified.json()["ok"] is True and verified.json()["events"] == 9  # + ops, root key

    # A change that fails is not audited, even if it failed after its first step.
    failed = await client.post(
        "/admin/api/tenants", json={"name": "initech", "plan": "missing"}, headers=admin
    )
    assert failed.status_code == 404
    [newest] = (await _events(client, admin, action="tenant.create", limit=1))["data"]
    assert newest["target"] == "tenant:globex"

    # Without an X-Request-Id, the gateway makes one and answers with it.
    plain = await client.post("/admin/api/plans", json={"name": "silver"}, headers=admin)
    [event] = (await _events(client, admin, action="plan.create", limit=1))["data"]
    assert event["target"] == "plan:silver"
    assert event["request_id"] == plain.headers["x-request-id"]
    assert event["request_id"].startswith("req_")


async def test_audit_api_pages_filters_and_refuses_tenants(
    client: AsyncTestClient[Any], sessions: Sessions, tenant_key: str
) -> None:
    admin, _ = await _admin(sessions)
    await _record_many(sessions, 5)
    pages, cursor = [], None
    for _ in range(3):
        query = {"action": "plan.update", "limit": 2} | ({"cursor": cursor} if cursor else {})
        pages.append(await _events(client, admin, **query))
        cursor = pages[-1]["next_cursor"]
    targets = [event["target"] for page in pages for event in page["data"]]
    assert targets == [f"plan:p{number}" for number in (4, 3, 2, 1, 0)]
    assert cursor is None

    future = await _events(client, admin, since="2999-01-01T00:00:00Z")
    assert future["data"] == []
    newest = datetime.fromisoformat(pages[0]["data"][0]["time"])
    in_paris = (newest - timedelta(seconds=1)).astimezone(timezone(timedelta(hours=1)))
    recent = await _events(client, admin, since=in_paris.isoformat(), action="plan.update")
    assert recent["data"][0]["id"] == pages[0]["data"][0]["id"]  # other zones: converted
    assert len((await _events(client, admin, until="2999-01-01T00:00:00"))["data"]) >= 5
    bad_time = await client.get("/admin/api/audit", params={"since": "yesterday"}, headers=admin)
    assert bad_time.status_code == 400 and bad_time.json()["error"]["param"] == "since"
    bad_limit = await client.get("/admin/api/audit", params={"limit": 0}, headers=admin)
    assert bad_limit.status_code == 400
    unknown = await client.get("/admin/api/audit", params={"tenant": "nobody"}, headers=admin)
    assert unknown.status_code == 404

    tenant = {"Authorization": f"Bearer {tenant_key}"}
    assert (await client.get("/admin/api/audit", headers=tenant)).status_code == 403
    assert (await client.post("/admin/api/audit/verify", headers=tenant)).status_code == 403


async def test_verify_endpoint_names_the_first_bad_event(
    client: AsyncTestClient[Any], sessions: Sessions, database_url: str
) -> None:
    admin, _ = await _admin(sessions)
    await _record_many(sessions, 3)
    intact = (await client.post("/admin/api/audit/verify", headers=admin)).json()
    assert (intact["ok"], intact["events"], intact["anchor"][:2]) == (True, 5, "5:")
    _as_superuser(database_url, "UPDATE audit_events SET target = 'plan:forged' WHERE id = 4")
    result = (await client.post("/admin/api/audit/verify", headers=admin)).json()
    assert (result["ok"], result["first_bad_id"]) == (False, 4)
    assert result["reason"].startswith("hash mismatch")
    assert result["anchor"] is None
    _as_superuser(database_url, "DELETE FROM audit_events WHERE id >= 4")
    cut = await client.post(
        "/admin/api/audit/verify", params={"anchor": intact["anchor"]}, headers=admin
    )
    assert (cut.json()["ok"], cut.json()["first_bad_id"]) == (False, 4)
    bad = await client.post("/admin/api/audit/verify", params={"anchor": "x"}, headers=admin)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "anchor"


async def test_revoked_key_use_is_audited_once_a_minute(
    client: AsyncTestClient[Any], sessions: Sessions
) -> None:
    admin, _ = await _admin(sessions)
    async with sessions.begin() as session:
        tenant = await TenantService(session).create("acme")
        created = await ApiKeyService(session).create(tenant, "ci")
        await ApiKeyService(session).revoke(created.key.id)
    revoked = {"Authorization": f"Bearer {created.secret}", "User-Agent": "attacker/0.1"}
    refusals = [await client.get("/v1/models", headers=revoked) for _ in range(3)]
    assert [refusal.status_code for refusal in refusals] == [401, 401, 401]
    events = (await _events(client, admin, action="auth.revoked_key"))["data"]
    assert len(events) == 1
    assert events[0]["request_id"] == refusals[0].headers["x-request-id"]
    assert events[0]["target"] == f"key:{created.key.prefix}"
    assert events[0]["tenant_id"] == tenant.id
    assert events[0]["user_agent"] == "attacker/0.1"
    assert created.secret not in json.dumps(events)
    # A wrong secret with a revoked key's prefix is an ordinary failure, not key use.
    wrong = created.secret[:-4] + "abcd"
    assert (await client.get("/v1/models", headers={"Authorization": f"Bearer {wrong}"})).is_error
    assert len((await _events(client, admin, action="auth.revoked_key"))["data"]) == 1


async def test_auth_failures_are_counted_then_written_once_per_window(
    client: AsyncTestClient[Any], sessions: Sessions, tenant_key: str
) -> None:
    admin, _ = await _admin(sessions)
    unknown_key = "tg-AAAAAAAA_" + "s" * 43
    attempts = [
        {"Authorization": f"Bearer {unknown_key}"},
        {"Authorization": f"Bearer {unknown_key}"},
        {"Authorization": "Bearer not-a-key-at-all"},
        {},
    ]
    for headers in attempts:
        assert (await client.get("/v1/models", headers=headers)).status_code == 401
    not_admin = {"Authorization": f"Bearer {tenant_key}"}
    assert (await client.get("/admin/api/tenants", headers=not_admin)).status_code == 403
    assert (await _events(client, admin, action="auth.failures"))["data"] == []  # no hot writes

    failures = client.app.state.runtime.auth_failures
    event = await failures.flush()
    assert event is not None and await failures.flush() is None  # the window was emptied
    [stored] = (await _events(client, admin, action="auth.failures"))["data"]
    details = stored["details"]
    assert details["total"] == 5
    counts = {(row["key_prefix"], row["reason"]): row["count"] for row in details["sources"]}
    assert counts == {
        ("tg-AAAAAAAA", "invalid_key"): 2,
        ("-", "invalid_key"): 1,
        ("-", "missing_key"): 1,
        (tenant_key.split("_")[0], "admin_required"): 1,
    }
    assert "s" * 43 not in json.dumps(stored)  # never the presented secret
    assert tenant_key.split("_", 1)[1] not in json.dumps(stored)


async def test_auth_failures_survive_a_failed_flush(sessions: Sessions) -> None:
    from gateway.admission.auth_failures import AuthFailureLog

    failing = db.create_engine("sqlite:////nonexistent-dir/none.db")
    log = AuthFailureLog(db.session_factory(failing), max_sources=2)
    for ip in ("10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.3"):
        log.note(ip, "tg-AAAAAAAA", "invalid_key")
    with pytest.raises(Exception):  # noqa: B017 - whatever the driver raises
        await log.flush()
    await failing.dispose()
    log.sessions = sessions
    event = await log.flush()
    assert event is not None
    assert event.details["total"] == 4 and event.details["other"] == 1  # capped, not lost


def test_cli_changes_are_audited_and_verify_reports(
    database_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TOLLGATE_DATABASE_URL", database_url)
    monkeypatch.setattr(getpass, "getuser", lambda: "alice")
    for argv in (
        ["plans", "create", "gold", "--rpm", "10"],
        ["tenants", "create", "acme", "--plan", "gold"],
        ["keys", "create", "--tenant", "acme"],
    ):
        assert cli.main(argv) == 0
    secret = capsys.readouterr().out.strip().splitlines()[-1]

    assert cli.main(["audit", "list", "--tenant", "acme"]) == 0
    listed = capsys.readouterr().out
    assert "cli:alice\tkey.create" in listed and "cli:alice\ttenant.set_plan" in listed
    assert "plan.create" not in listed  # not a tenant's event
    assert secret not in listed

    assert cli.main(["audit", "verify"]) == 0
    intact = capsys.readouterr().out
    assert intact.startswith("chain intact: 4 events (anchor 4:")
    anchor = intact.split("anchor ")[1].rstrip(")\n")
    _as_superuser(database_url, "DELETE FROM audit_events WHERE id = 2")
    assert cli.main(["audit", "verify"]) == 1
    assert "chain broken at event 3: sequence gap" in capsys.readouterr().err
    _as_superuser(database_url, "DELETE FROM audit_events WHERE id >= 3")
    assert cli.main(["audit", "verify"]) == 0  # what is left is a consistent chain…
    assert cli.main(["audit", "verify", "--anchor", anchor]) == 1  # …shorter than the anchor
    assert "chain broken at event 2" in capsys.readouterr().err


async def test_services_audit_as_system_by_default(sessions: Sessions) -> None:
    async with sessions.begin() as session:
        await TenantService(session).create("acme")
        await TenantService(session, Actor("cli:bob")).create("globex")
    async with sessions() as session:
        events = await audit.list_events(session)
    assert [(event.actor, event.target) for event in events] == [
        ("cli:bob", "tenant:globex"),
        ("system", "tenant:acme"),
    ]


async def test_record_unless_within_rate_limits_per_action_and_target(sessions: Sessions) -> None:
    async def attempt(target: str, within: timedelta) -> bool:
        async with sessions.begin() as session:
            event = await audit.record(
                session,
                actor="key:k",
                action="auth.revoked_key",
                target=target,
                unless_within=within,
            )
        return event is not None

    hour = timedelta(hours=1)
    assert [await attempt("key:a", hour) for _ in range(3)] == [True, False, False]
    assert await attempt("key:b", hour)  # another key is another event
    assert await attempt("key:a", timedelta(0))  # once the interval has passed, again
    assert (await _verify(sessions)).events == 3


async def test_adopting_the_operators_admin_key_is_audited(
    settings: Settings, sessions: Sessions
) -> None:
    secret = keys.generate_key()[0]
    await ensure_admin_key(replace(settings, admin_key=secret), sessions)
    async with sessions() as session:
        events = await audit.list_events(session, action="key.create")
    assert [(event.actor, event.target) for event in events] == [
        ("system", f"key:{keys.key_prefix(secret)}")
    ]
    assert events[0].details["from"] == "TOLLGATE_ADMIN_KEY"
    assert secret not in json.dumps(events[0].details)
