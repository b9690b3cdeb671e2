from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import pytest
from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from tenants import audit
from tenants.audit import Actor
from tenants.billing.prices import PriceService
from tenants.errors import ConflictError, InvalidInputError, NotFoundError
from tenants.limits import LimitSet, PlanTerms
from tenants.models import ApiKey, KeyRole, utcnow
from tenants.pricing import Price
from tenants.services import ApiKeyService, PlanService, TenantService

Sessions = async_sessionmaker[AsyncSession]


async def test_tenant_names_are_unique_and_validated(sessions: Sessions) -> None:
    async with sessions.begin() as session:
        await TenantService(session).create("acme")
    async with sessions.begin() as session:
        with pytest.raises(ConflictError):
            await TenantService(session).create("acme")
        with pytest.raises(InvalidInputError):
            await TenantService(session).create("Not Valid!")
        with pytest.raises(NotFoundError):
            await TenantService(session).get("nobody")
        assert [t.name for t in await TenantService(session).list()] == ["acme"]


async def test_key_authenticates_until_revoked(sessions: Sessions) -> None:
    async with sessions.begin() as session:
        tenant = await TenantService(session).create("acme")
        created = await ApiKeyService(session).create(tenant, "ci")
    async with sessions.begin() as session:
        principal = await ApiKeyService(session).authenticate(created.secret)
        assert principal is not None
        assert (principal.tenant_name, principal.key_id, principal.role) == (
            "acme",
            created.key.id,
            KeyRole.TENANT,
        )
        assert await ApiKeyService(session).authenticate(created.secret[:-1] + "x") is None
    async with sessions.begin() as session:
        await ApiKeyService(session).revoke(created.key.prefix)
    async with sessions.begin() as session:
        assert await ApiKeyService(session).authenticate(created.secret) is None
        with pytest.raises(NotFoundError):
            await ApiKeyService(session).revoke("tg-nothing")


async def test_database_never_holds_the_key_in_plain_text(sessions: Sessions) -> None:
    async with sessions.begin() as session:
        tenant = await TenantService(session).create("acme")
        secret = (await ApiKeyService(session).create(tenant)).secret
    async with sessions() as session:
        rows = (await session.execute(text("SELECT * FROM api_keys"))).all()
    stored = " ".join(str(value) for row in rows for value in row)
    assert len(rows) == 1
    assert secret not in stored
    assert secret.split("_", 1)[1] not in stored  # not even the secret half
    assert secret.split("_", 1)[0] in stored  # the visible prefix is there


async def test_last_used_is_written_at_most_once_a_minute(sessions: Sessions) -> None:
    async with sessions.begin() as session:
        tenant = await TenantService(session).create("acme")
        created = await ApiKeyService(session).create(tenant)
    first = utcnow()
    for offset in (0, 30, 61):
        async with sessions.begin() as session:
            await ApiKeyService(session).authenticate(
                created.secret, first + timedelta(seconds=offset)
            )
    async with sessions() as session:
        key = (await session.execute(select(ApiKey))).scalar_one()
    assert key.last_used_at is not None
    last_used = key.last_used_at
    if last_used.tzinfo is None:  # SQLite keeps naive UTC
        last_used = last_used.replace(tzinfo=first.tzinfo)
    assert last_used == first + timedelta(seconds=61)


async def _audit_actions(sessions: Sessions) -> list[tuple[str, str, str]]:
    async with sessions() as session:
        events = await audit.list_events(session, limit=100)
    return [(e.actor, e.action, e.target) for e in reversed(events)]


async def test_creating_a_tenant_writes_exactly_one_audit_row(sessions: Sessions) -> None:
    async with sessions.begin() as session:
        await TenantService(session, Actor("cli:bob")).create("acme")
    assert await _audit_actions(sessions) == [("cli:bob", "tenant.create", "tenant:acme")]


async def test_a_tenant_created_on_a_plan_is_on_it_and_both_steps_are_audited(
    sessions: Sessions,
) -> None:
    async with sessions.begin() as session:
        plan = await PlanService(session).create("basic", PlanTerms())
        tenant = await TenantService(session, Actor("cli:bob")).create("acme", "basic")
    assert tenant.plan_id == plan.id
    assert await _audit_actions(sessions) == [
        ("system", "plan.create", "plan:basic"),
        ("cli:bob", "tenant.create", "tenant:acme"),
        ("cli:bob", "tenant.set_plan", "tenant:acme"),
    ]


async def test_a_failed_use_case_rolls_back_and_leaves_no_audit_row(sessions: Sessions) -> None:
    with pytest.raises(NotFoundError, match="no plan named 'missing'"):
        async with sessions.begin() as session:
            await TenantService(session, Actor("cli:bob")).create("acme", "missing")
    async with sessions() as session:
        assert await TenantService(session).find("acme") is None
    assert await _audit_actions(sessions) == []


async def test_a_plan_update_edits_the_current_terms_audited_once(sessions: Sessions) -> None:
    async with sessions.begin() as session:
        await PlanService(session).create("basic", PlanTerms(limits=LimitSet(rpm=5, tpm=100)))
    async with sessions.begin() as session:
        plan = await PlanService(session, Actor("cli:bob")).update(
            "basic", lambda terms: replace(terms, limits=replace(terms.limits, rpm=7))
        )
    assert (plan.rpm, plan.tpm) == (7, 100)  # tpm kept from the current terms
    async with sessions() as session:
        (event,) = await audit.list_events(session, action="plan.update")
    assert (event.actor, event.details["changes"]) == ("cli:bob", {"rpm": [5, 7]})


async def test_key_limits_can_be_edited_from_the_current_ones(sessions: Sessions) -> None:
    async with sessions.begin() as session:
        tenant = await TenantService(session).create("acme")
        created = await ApiKeyService(session).create(tenant)
        await ApiKeyService(session).set_limits(created.key.id, LimitSet(rpm=5, tpm=100))
    async with sessions.begin() as session:
        key = await ApiKeyService(session).set_limits(
            created.key.prefix, lambda limits: replace(limits, tpm=None)
        )
    assert LimitSet.of(key) == LimitSet(rpm=5)


async def test_a_price_version_audits_itself_as_its_creator(sessions: Sessions) -> None:
    async with sessions.begin() as session:
        version = await PriceService(session, Actor("cli:bob")).create(
            "tiny", Price(1, 1, 2), utcnow()
        )
    assert version.created_by == "cli:bob"
    async with sessions() as session:
        (event,) = await audit.list_events(session, action="price.create")
    assert (event.actor, event.target) == ("cli:bob", "price:tiny")
    assert event.details["version_id"] == version.id
    assert event.details["output_micros_per_mtok"] == 2
