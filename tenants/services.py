"""Services over the tenant domain. Each takes an AsyncSession; callers own the transaction."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from tenants import keys
from tenants.errors import ConflictError, InvalidInputError, NotFoundError
from tenants.limits import LimitSet, PlanTerms, check_priorities
from tenants.models import ApiKey, KeyRole, KeyStatus, Plan, Tenant, UsageEvent, utcnow

_TENANT_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,99}$")
LAST_USED_GRANULARITY = timedelta(minutes=1)


@dataclass(frozen=True)
class Principal:
    """Who is calling, and on what terms: the result of authenticating an API key."""

    tenant_id: str
    tenant_name: str
    key_id: str
    role: KeyRole
    plan: PlanTerms = field(default_factory=PlanTerms)
    key_limits: LimitSet = field(default_factory=LimitSet)  # overrides, inside the plan's


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

    async def get_by_id(self, tenant_id: str) -> Tenant:
        tenant = await self.session.get(Tenant, tenant_id)
        if tenant is None:
            raise NotFoundError(f"no tenant with id {tenant_id!r}")
        return tenant

    async def list(self) -> list[Tenant]:
        result = await self.session.execute(select(Tenant).order_by(Tenant.name))
        return list(result.scalars())

    async def set_plan(self, name: str, plan_name: str | None) -> Tenant:
        tenant = await self.get(name)
        tenant.plan_id = (
            None if plan_name is None else (await PlanService(self.session).get(plan_name)).id
        )
        return tenant


class PlanService:
    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def create(self, name: str, terms: PlanTerms) -> Plan:
        if not _TENANT_NAME.match(name):
            raise InvalidInputError("plan name must be 1-100 characters of a-z, 0-9, '_', '.', '-'")
        if await self.find(name) is not None:
            raise ConflictError(f"plan {name!r} already exists")
        plan = Plan(name=name)
        self._apply(plan, terms)
        self.session.add(plan)
        await self.session.flush()
        return plan

    async def update(self, name: str, terms: PlanTerms) -> Plan:
        plan = await self.get(name)
        self._apply(plan, terms)
        await self.session.flush()
        return plan

    @staticmethod
    def _apply(plan: Plan, terms: PlanTerms) -> None:
        check_priorities(terms.default_priority, terms.max_priority, terms.weight)
        terms.limits.apply_to(plan)
        models = terms.allowed_models
        plan.allowed_models = None if models is None else sorted(models)
        plan.default_priority = terms.default_priority
        plan.max_priority = terms.max_priority
        plan.weight = terms.weight

    async def find(self, name: str) -> Plan | None:
        return await self.session.scalar(select(Plan).where(Plan.name == name))

    async def get(self, name: str) -> Plan:
        plan = await self.find(name)
        if plan is None:
            raise NotFoundError(f"no plan named {name!r}")
        return plan

    async def list(self) -> list[Plan]:
        return list((await self.session.execute(select(Plan).order_by(Plan.name))).scalars())


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

    async def get(self, key_id_or_prefix: str) -> ApiKey:
        result = await self.session.execute(
            select(ApiKey).where(
                (ApiKey.id == key_id_or_prefix) | (ApiKey.prefix == key_id_or_prefix)
            )
        )
        key = result.scalar_one_or_none()
        if key is None:
            raise NotFoundError(f"no API key with id or prefix {key_id_or_prefix!r}")
        return key

    async def set_limits(self, key_id_or_prefix: str, limits: LimitSet) -> ApiKey:
        key = await self.get(key_id_or_prefix)
        limits.apply_to(key)
        return key

    async def revoke(self, key_id_or_prefix: str) -> ApiKey:
        key = await self.get(key_id_or_prefix)
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
            select(ApiKey, Tenant.name, Plan)
            .join(Tenant, Tenant.id == ApiKey.tenant_id)
            .outerjoin(Plan, Plan.id == Tenant.plan_id)
            .where(ApiKey.prefix == prefix)
        )
        row = result.one_or_none()
        if row is None:
            return None
        key, tenant_name, plan = row
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
            tenant_id=key.tenant_id,
            tenant_name=tenant_name,
            key_id=key.id,
            role=KeyRole(key.role),
            plan=PlanTerms.of(plan),
            key_limits=LimitSet.of(key),
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
