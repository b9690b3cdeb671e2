"""Services over the tenant domain. Each takes an AsyncSession; callers own the transaction."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from tenants import keys
from tenants.errors import ConflictError, InvalidInputError, NotFoundError
from tenants.models import ApiKey, KeyRole, KeyStatus, Tenant, UsageEvent, utcnow

_TENANT_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,99}$")
LAST_USED_GRANULARITY = timedelta(minutes=1)


@dataclass(frozen=True)
class Principal:
    """Who is calling: the result of authenticating an API key."""

    tenant_id: str
    tenant_name: str
    key_id: str
    role: KeyRole


@dataclass(frozen=True)
class CreatedKey:
    key: ApiKey
    secret: str  # shown once, never stored


class TenantService:
    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def create(self, name: str) -> Tenant:
        if not _TENANT_NAME.match(name):
            raise InvalidInputError(
                "tenant name must be 1-100 characters of a-z, 0-9, '_', '.', '-', "
                "starting with a letter or digit"
            )
        if await self.find(name) is not None:
            raise ConflictError(f"tenant {name!r} already exists")
        tenant = Tenant(name=name)
        self.session.add(tenant)
        await self.session.flush()
        return tenant

    async def find(self, name: str) -> Tenant | None:
        result = await self.session.execute(select(Tenant).where(Tenant.name == name))
        return result.scalar_one_or_none()

    async def get(self, name: str) -> Tenant:
        tenant = await self.find(name)
        if tenant is None:
            raise NotFoundError(f"no tenant named {name!r}")
        return tenant

    async def list(self) -> list[Tenant]:
        result = await self.session.execute(select(Tenant).order_by(Tenant.name))
        return list(result.scalars())


class ApiKeyService:
    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def create(
        self, tenant: Tenant, name: str = "", role: KeyRole = KeyRole.TENANT
    ) -> CreatedKey:
        secret, prefix = keys.generate_key()
        key = ApiKey(
            tenant_id=tenant.id, prefix=prefix, key_hash=keys.hash_key(secret), name=name, role=role
        )
        self.session.add(key)
        await self.session.flush()
        return CreatedKey(key=key, secret=secret)

    async def list(self, tenant: Tenant | None = None) -> list[tuple[ApiKey, str]]:
        """Keys with their tenant's name, optionally for one tenant only."""
        query = select(ApiKey, Tenant.name).join(Tenant, Tenant.id == ApiKey.tenant_id)
        if tenant is not None:
            query = query.where(ApiKey.tenant_id == tenant.id)
        result = await self.session.execute(query.order_by(Tenant.name, ApiKey.created_at))
        return [(key, tenant_name) for key, tenant_name in result.all()]

    async def revoke(self, key_id_or_prefix: str) -> ApiKey:
        result = await self.session.execute(
            select(ApiKey).where(
                (ApiKey.id == key_id_or_prefix) | (ApiKey.prefix == key_id_or_prefix)
            )
        )
        key = result.scalar_one_or_none()
        if key is None:
            raise NotFoundError(f"no API key with id or prefix {key_id_or_prefix!r}")
        if key.status != KeyStatus.REVOKED:
            key.status = KeyStatus.REVOKED
            key.revoked_at = utcnow()
        return key

    async def authenticate(self, secret: str, now: datetime | None = None) -> Principal | None:
        """The caller behind `secret`, or None for an unknown, malformed or revoked key."""
        prefix = keys.key_prefix(secret)
        if prefix is None:
            return None
        result = await self.session.execute(
            select(ApiKey, Tenant.name)
            .join(Tenant, Tenant.id == ApiKey.tenant_id)
            .where(ApiKey.prefix == prefix)
        )
        row = result.one_or_none()
        if row is None:
            return None
        key, tenant_name = row
        if not keys.matches(secret, key.key_hash) or key.status != KeyStatus.ACTIVE:
            return None
        now = now or utcnow()
        last_used = key.last_used_at
        # SQLite hands back naive datetimes; all stored times are UTC.
        if last_used is not None and last_used.tzinfo is None:
            last_used = last_used.replace(tzinfo=now.tzinfo)
        if last_used is None or now - last_used >= LAST_USED_GRANULARITY:
            key.last_used_at = now  # one write a minute per key, not one per request
        return Principal(
            tenant_id=key.tenant_id, tenant_name=tenant_name, key_id=key.id, role=KeyRole(key.role)
        )

    async def count_admin_keys(self) -> int:
        result = await self.session.execute(
            select(func.count())
            .select_from(ApiKey)
            .where(ApiKey.role == KeyRole.ADMIN, ApiKey.status == KeyStatus.ACTIVE)
        )
        return int(result.scalar_one())


class UsageService:
    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def record(self, event: UsageEvent) -> None:
        self.session.add(event)
        await self.session.flush()

    async def for_tenant(self, tenant_id: str, limit: int = 100) -> list[UsageEvent]:
        result = await self.session.execute(
            select(UsageEvent)
            .where(UsageEvent.tenant_id == tenant_id)
            .order_by(UsageEvent.created_at.desc())
            .limit(limit)
        )
        return list(result.scalars())
