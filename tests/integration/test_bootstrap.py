from __future__ import annotations

import stat
from dataclasses import replace
from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.cli.bootstrap import AdminKey, ConsoleOwner, ensure_admin_key, ensure_console_owner
from gateway.cli.serve import _banner
from gateway.settings import Settings, SettingsError
from tenants import db, keys
from tenants.admins import AdminService
from tenants.models import KeyRole, Tenant
from tenants.services import ApiKeyService, TenantService

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


async def test_an_admin_key_file_others_can_read_is_made_owner_only(
    settings: Settings, sessions: Sessions
) -> None:
    first = await ensure_admin_key(settings, sessions)
    settings.admin_key_file.chmod(0o644)
    again = await ensure_admin_key(settings, sessions)
    assert again.secret == first.secret
    assert stat.S_IMODE(settings.admin_key_file.stat().st_mode) == 0o600


async def test_a_rewritten_admin_key_file_is_owner_only(
    settings: Settings, sessions: Sessions
) -> None:
    """A key file left behind by a revoked key, readable by others, is replaced owner-only."""
    first = await ensure_admin_key(settings, sessions)
    assert first.secret is not None
    async with sessions.begin() as session:
        await ApiKeyService(session).revoke(first.secret.split("_")[0])
    settings.admin_key_file.chmod(0o644)
    assert (await ensure_admin_key(settings, sessions)).created
    assert stat.S_IMODE(settings.admin_key_file.stat().st_mode) == 0o600


async def test_the_embedded_database_is_created_owner_only(tmp_path: Path) -> None:
    """It holds password hashes and stored completions: a 0700 folder, 0600 files."""
    path = tmp_path / "fresh" / "data" / "tollgate.db"
    url = f"sqlite:///{path}"
    db.upgrade(url)
    engine = db.create_engine(url)
    try:
        async with db.session_factory(engine).begin() as session:
            await TenantService(session).create("acme")  # a write: the WAL file exists now
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        files = [p for p in path.parent.iterdir() if p.name.startswith("tollgate.db")]
        assert {p.name for p in files} >= {"tollgate.db", "tollgate.db-wal"}
        assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in files} == {
            p.name: 0o600 for p in files
        }
    finally:
        await engine.dispose()


async def test_a_replica_that_loses_the_race_for_the_admin_tenant_finds_the_winners(
    settings: Settings, sessions: Sessions, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two replicas start at once on a fresh database: the other commits the admin tenant
    and its key between this replica's look for the tenant and its insert."""
    real_find = TenantService.find
    winner: list[AdminKey] = []

    async def find_while_another_replica_wins(self: TenantService, name: str) -> Tenant | None:
        found = await real_find(self, name)
        if not winner:
            # The other replica, and this one's retry, look for real.
            monkeypatch.setattr(TenantService, "find", real_find)
            winner.append(await ensure_admin_key(settings, sessions))
        return found

    monkeypatch.setattr(TenantService, "find", find_while_another_replica_wins)
    loser = await ensure_admin_key(settings, sessions)
    assert winner[0].created and not loser.created
    assert loser.secret == winner[0].secret  # read back from the shared data folder
    async with sessions.begin() as session:
        assert await ApiKeyService(session).count_admin_keys() == 1


async def test_a_replica_that_loses_the_race_for_the_console_owner_creates_nothing(
    sessions: Sessions, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_count = AdminService.count
    winner: list[ConsoleOwner | None] = []

    async def count_while_another_replica_wins(self: AdminService) -> int:
        counted = await real_count(self)
        if not winner:
            monkeypatch.setattr(AdminService, "count", real_count)
            winner.append(await ensure_console_owner(sessions))
        return counted

    monkeypatch.setattr(AdminService, "count", count_while_another_replica_wins)
    assert await ensure_console_owner(sessions) is None
    assert winner[0] is not None
    async with sessions.begin() as session:
        assert await real_count(AdminService(session)) == 1


def banner(settings: Settings, admin: AdminKey, capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    _banner(settings, admin, "tollgate-tiny")
    return capsys.readouterr().out


async def test_the_admin_key_is_printed_once_then_only_its_prefix(
    settings: Settings, sessions: Sessions, capsys: pytest.CaptureFixture[str]
) -> None:
    """stdout is the log in a container: a generated key is printed on the start that made
    it, with a curl to paste; later starts print its prefix and how to read it."""
    first = await ensure_admin_key(settings, sessions)
    assert first.secret is not None
    shown = banner(settings, first, capsys)
    assert f"Admin key (new): {first.secret}" in shown
    assert f"-H 'Authorization: Bearer {first.secret}'" in shown  # ready to paste

    later = banner(settings, await ensure_admin_key(settings, sessions), capsys)
    assert first.secret not in later
    assert f"Admin key: {first.secret.split('_')[0]}_…" in later
    assert f"export TOLLGATE_KEY=$(cat {settings.admin_key_file})" in later
    assert "-H 'Authorization: Bearer $TOLLGATE_KEY'" in later


async def test_an_operator_given_admin_key_is_never_printed(
    settings: Settings, sessions: Sessions, capsys: pytest.CaptureFixture[str]
) -> None:
    secret, _ = keys.generate_key()
    configured = replace(settings, admin_key=secret)
    for _ in range(2):  # adopted (created), then found
        printed = banner(configured, await ensure_admin_key(configured, sessions), capsys)
        assert secret not in printed
        assert f"Admin key: {secret.split('_')[0]}_… (TOLLGATE_ADMIN_KEY)" in printed
        assert "-H 'Authorization: Bearer $TOLLGATE_KEY'" in printed
