"""The first admin key: from TOLLGATE_ADMIN_KEY, or generated once into the data folder."""

from __future__ import annotations

import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.settings import Settings, SettingsError
from tenants import audit, keys
from tenants.admins import AdminRole, AdminService
from tenants.errors import ConflictError
from tenants.models import ApiKey, KeyRole, Tenant
from tenants.services import ApiKeyService, TenantService

ADMIN_TENANT = "admin"


@dataclass(frozen=True)
class AdminKey:
    secret: str | None  # None when an admin key exists but its secret is not known here
    created: bool
    supplied: bool = False  # the operator's TOLLGATE_ADMIN_KEY: they have it already

    @property
    def shown(self) -> str | None:
        """The secret to print: only a key generated just now, once (stdout is a log in
        a container); otherwise none."""
        return self.secret if self.created and not self.supplied else None

    @property
    def prefix(self) -> str | None:
        """The key's visible prefix (as the admin API and the console list keys)."""
        return keys.key_prefix(self.secret) if self.secret is not None else None


async def ensure_admin_key(
    settings: Settings, sessions: async_sessionmaker[AsyncSession]
) -> AdminKey:
    """Idempotent, and safe when several replicas start at once: a replica that loses the
    race to create the admin tenant or key finds the winner's on its second look (the loss
    shows as the unique index's IntegrityError, or as the service's ConflictError when the
    winner committed between the replica's look and its insert)."""
    try:
        return await _ensure_admin_key(settings, sessions)
    except (IntegrityError, ConflictError):
        return await _ensure_admin_key(settings, sessions)


async def _ensure_admin_key(
    settings: Settings, sessions: async_sessionmaker[AsyncSession]
) -> AdminKey:
    async with sessions.begin() as session:
        tenant = await _admin_tenant(session)
        if settings.admin_key is not None:
            created = await _adopt(session, tenant, settings.admin_key)
            return AdminKey(settings.admin_key, created, supplied=True)
        service = ApiKeyService(session)
        if await service.count_admin_keys() > 0:
            return AdminKey(await _known_admin_key(settings, service), created=False)
        created_key = await service.create(tenant, "bootstrap", KeyRole.ADMIN)
    _write_key_file(settings, created_key.secret)
    return AdminKey(created_key.secret, created=True)


async def _admin_tenant(session: AsyncSession) -> Tenant:
    service = TenantService(session)
    return await service.find(ADMIN_TENANT) or await service.create(ADMIN_TENANT)


async def _adopt(session: AsyncSession, tenant: Tenant, secret: str) -> bool:
    """Store the hash of a key given by the operator, unless it is already there."""
    prefix = keys.key_prefix(secret)
    if prefix is None:
        raise SettingsError(
            "TOLLGATE_ADMIN_KEY is not a Tollgate key (tg-XXXXXXXX_…); "
            "make one with `tollgate keys create --tenant admin --admin`"
        )
    existing = await session.scalar(select(ApiKey).where(ApiKey.prefix == prefix))
    if existing is not None:
        if not keys.matches(secret, existing.key_hash):
            raise SettingsError("TOLLGATE_ADMIN_KEY clashes with another key's prefix")
        return False
    key = ApiKey(
        tenant_id=tenant.id,
        prefix=prefix,
        key_hash=keys.hash_key(secret),
        name="bootstrap",
        role=KeyRole.ADMIN,
    )
    session.add(key)
    await session.flush()
    await audit.record(
        session,
        actor="system",
        action="key.create",
        target=f"key:{prefix}",
        tenant_id=tenant.id,
        details={"key_id": key.id, "name": key.name, "role": "admin", "from": "TOLLGATE_ADMIN_KEY"},
    )
    return True


async def _known_admin_key(settings: Settings, service: ApiKeyService) -> str | None:
    """The key in the data folder, if it is still a working admin key. A file others may
    read (copied, or made before the folder was owner-only) is made owner-only first."""
    try:
        _owner_only(settings.admin_key_file)
        secret = settings.admin_key_file.read_text().strip()
    except FileNotFoundError:
        return None
    principal = await service.authenticate(secret)
    return secret if principal is not None and principal.role == KeyRole.ADMIN else None


def _write_key_file(settings: Settings, secret: str) -> None:
    """Owner-only file so `make run` can show the key again; like a Jupyter token."""
    settings.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(settings.admin_key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # the mode above applies only to a file created now
    with os.fdopen(fd, "w") as handle:
        handle.write(secret + "\n")


def _owner_only(path: Path) -> None:
    if stat.S_IMODE(path.stat().st_mode) & 0o077:
        try:
            path.chmod(0o600)
        except PermissionError:
            message = f"{path} is readable by others and not ours to fix: chmod 600 it"
            raise SettingsError(message) from None


CONSOLE_OWNER_EMAIL = "owner@localhost"


@dataclass(frozen=True)
class ConsoleOwner:
    email: str
    password: str | None  # only when created just now: printed once, never stored


async def ensure_console_owner(sessions: async_sessionmaker[AsyncSession]) -> ConsoleOwner | None:
    """The first console owner, with a generated password, when there is no administrator
    yet; None when administrators exist. A replica that loses the race creates nothing."""
    password = secrets.token_urlsafe(15)
    try:
        async with sessions.begin() as session:
            service = AdminService(session)
            if await service.count() > 0:
                return None
            await service.create(CONSOLE_OWNER_EMAIL, AdminRole.OWNER, password)
    except (IntegrityError, ConflictError):
        return None
    return ConsoleOwner(CONSOLE_OWNER_EMAIL, password)
