from __future__ import annotations

import stat
from dataclasses import replace

import pytest
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.bootstrap import ensure_admin_key
from gateway.settings import Settings, SettingsError
from tenants import keys
from tenants.models import KeyRole
from tenants.services import ApiKeyService

Sessions = async_sessionmaker[AsyncSession]


async def test_first_start_creates_one_admin_key(settings: Settings, sessions: Sessions) -> None:
    first = await ensure_admin_key(settings, sessions)
    assert first.created
    assert first.secret is not None
    mode = stat.S_IMODE(settings.admin_key_file.stat().st_mode)
    assert mode == 0o600
    again = await ensure_admin_key(settings, sessions)
    assert (again.created, again.secret) == (False, first.secret)
    async with sessions.begin() as session:
        principal = await ApiKeyService(session).authenticate(first.secret)
        assert principal is not None
        assert principal.role == KeyRole.ADMIN
        assert await ApiKeyService(session).count_admin_keys() == 1


async def test_revoked_key_in_the_file_is_not_shown(settings: Settings, sessions: Sessions) -> None:
    first = await ensure_admin_key(settings, sessions)
    assert first.secret is not None
    async with sessions.begin() as session:
        service = ApiKeyService(session)
        await service.revoke(first.secret.split("_")[0])
    replacement = await ensure_admin_key(settings, sessions)
    assert replacement.created
    assert replacement.secret != first.secret


async def test_operator_given_key_is_adopted_once(settings: Settings, sessions: Sessions) -> None:
    secret, _ = keys.generate_key()
    configured = replace(settings, admin_key=secret)
    assert (await ensure_admin_key(configured, sessions)).created
    assert not (await ensure_admin_key(configured, sessions)).created
    assert not settings.admin_key_file.exists()  # the operator already has it


async def test_malformed_operator_key_is_refused(settings: Settings, sessions: Sessions) -> None:
    with pytest.raises(SettingsError, match="TOLLGATE_ADMIN_KEY"):
        await ensure_admin_key(replace(settings, admin_key="hunter2"), sessions)
