from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from tenants.errors import ConflictError, InvalidInputError, NotFoundError
from tenants.models import ApiKey, KeyRole, utcnow
from tenants.services import ApiKeyService, TenantService

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
