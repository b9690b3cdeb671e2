"""Services over the tenant domain, one method per use-case, each audited inside. Each takes
an AsyncSession; callers own the transaction."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import Text, cast, func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from tenants import audit, keys
from tenants.audit import AuditContext, Audited
from tenants.billing import ledger
from tenants.errors import ConflictError, InvalidInputError, found
from tenants.limits import LIMIT_NAMES, LimitSet, PlanTerms, check_priorities
from tenants.models import (
    ApiKey,
    KeyGeneration,
    KeyRole,
    KeyStatus,
    Plan,
    Tenant,
    UsageEvent,
    as_utc,
    utcnow,
)
from tenants.named import ByName

_TENANT_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,99}$")
LAST_USED_GRANULARITY = timedelta(minutes=1)
REVOKED_KEY_AUDIT_INTERVAL = timedelta(minutes=1)  # at most one audit event per key per minute


@dataclass(frozen=True)
class Principal:
    """Who is calling, and on what terms: the result of authenticating an API key."""

    tenant_id: str
    tenant_name: str
    key_id: str
    role: KeyRole
    plan: PlanTerms = field(default_factory=PlanTerms)
    key_limits: LimitSet = field(default_factory=LimitSet)  # overrides, inside the plan's
    key_prefix: str = ""  # the key's visible prefix, safe to log

    @property
    def actor(self) -> str:
        """How the audit log names this caller."""
        return f"key:{self.key_prefix or self.key_id}"

    @classmethod
    def of(cls, key: ApiKey, tenant_name: str, plan: Plan | None) -> Principal:
        """The principal of an active key, its tenant's name and its plan (None: defaults)."""
        return cls(
            tenant_id=key.tenant_id,
            tenant_name=tenant_name,
            key_id=key.id,
            role=KeyRole(key.role),
            plan=PlanTerms.of(plan),
            key_limits=LimitSet.of(key),
            key_prefix=key.prefix,
        )


@dataclass(frozen=True)
class CreatedKey:
    key: ApiKey
    secret: str  # shown once, never stored


def _limits_view(limits: LimitSet) -> dict[str, object]:
    return {name: getattr(limits, name) for name in LIMIT_NAMES}


def _terms_view(terms: PlanTerms) -> dict[str, object]:
    models = None if terms.allowed_models is None else sorted(terms.allowed_models)
    return {
        **_limits_view(terms.limits),
        "allowed_models": models,
        "default_priority": terms.default_priority,
        "max_priority": terms.max_priority,
        "weight": terms.weight,
        "max_batch_tokens": terms.max_batch_tokens,
        "max_file_bytes": terms.max_file_bytes,
    }


def _changes(before: dict[str, object], after: dict[str, object]) -> dict[str, object]:
    """{field: [old, new]} for the fields that changed."""
    return {name: [before[name], after[name]] for name in after if before[name] != after[name]}


KEY_GENERATION_CHANNEL = "tollgate_key_generation"  # PostgreSQL's NOTIFY of a new generation

_BUMP = update(KeyGeneration).values(value=KeyGeneration.value + 1)
_BUMPED = _BUMP.returning(KeyGeneration.value).cte("bumped")
_BUMP_AND_NOTIFY = select(
    _BUMPED.c.value, func.pg_notify(KEY_GENERATION_CHANNEL, cast(_BUMPED.c.value, Text))
)
KEY_GENERATION_BUMPED = "key_generation_bumped"  # session.info: the value the commit makes


async def keys_changed(session: AsyncSession) -> None:
    """A key's standing changed (revoked, re-limited, its plan changed): bump the key
    generation in the caller's transaction, so every gateway forgets the keys it
    remembered the moment the change commits. On PostgreSQL the same statement notifies
    the new value, which PostgreSQL delivers to the gateways' listeners on commit only
    (gateway.admission.key_generation). The new value is left in `session.info` under
    KEY_GENERATION_BUMPED, so the process that commits it can learn it at once."""
    if session.get_bind().dialect.name == "postgresql":
        value = (await session.execute(_BUMP_AND_NOTIFY)).scalar()
        if value is not None:
            session.info[KEY_GENERATION_BUMPED] = int(value)
    else:
        await session.execute(_BUMP)


class TenantService(ByName[Tenant]):
    table, what = Tenant, "tenant"

    async def create(self, name: str, plan_name: str | None = None) -> Tenant:
        """A new tenant, on `plan_name` when given (else unlimited)."""
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
        await self._audit("tenant.create", f"tenant:{name}", tenant.id)
        if plan_name is not None:
            await self.set_plan(name, plan_name)
        return tenant

    async def get_by_id(self, tenant_id: str) -> Tenant:
        return found(await self.session.get(Tenant, tenant_id), f"no tenant with id {tenant_id!r}")

    async def set_plan(self, name: str, plan_name: str | None) -> Tenant:
        tenant = await self.get(name)
        previous = None if tenant.plan_id is None else await self.session.get(Plan, tenant.plan_id)
        tenant.plan_id = (
            None if plan_name is None else (await PlanService(self.session).get(plan_name)).id
        )
        await self._audit(
            "tenant.set_plan",
            f"tenant:{name}",
            tenant.id,
            plan=[None if previous is None else previous.name, plan_name],
        )
        await keys_changed(self.session)
        return tenant


class PlanService(ByName[Plan]):
    table, what = Plan, "plan"

    async def create(self, name: str, terms: PlanTerms) -> Plan:
        if not _TENANT_NAME.match(name):
            raise InvalidInputError("plan name must be 1-100 characters of a-z, 0-9, '_', '.', '-'")
        if await self.find(name) is not None:
            raise ConflictError(f"plan {name!r} already exists")
        plan = Plan(name=name)
        self._apply(plan, terms)
        self.session.add(plan)
        await self.session.flush()
        await self._audit("plan.create", f"plan:{name}", None, terms=_terms_view(terms))
        return plan

    async def update(self, name: str, edit: Callable[[PlanTerms], PlanTerms]) -> Plan:
        """Change a plan's terms to `edit(current terms)`."""
        plan = await self.get(name)
        current = PlanTerms.of(plan)
        before = _terms_view(current)
        self._apply(plan, edit(current))
        await self.session.flush()
        after = _terms_view(PlanTerms.of(plan))
        await self._audit("plan.update", f"plan:{name}", None, changes=_changes(before, after))
        await keys_changed(self.session)
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
        for name in ("max_batch_tokens", "max_file_bytes"):
            value = getattr(terms, name)
            if value is not None and value < 0:
                raise InvalidInputError(f"{name} must be a whole number >= 0 or unset")
        plan.max_batch_tokens = terms.max_batch_tokens
        plan.max_file_bytes = terms.max_file_bytes


class ApiKeyService(Audited):
    async def create(
        self, tenant: Tenant, name: str = "", role: KeyRole = KeyRole.TENANT
    ) -> CreatedKey:
        secret, prefix = keys.generate_key()
        key = ApiKey(
            tenant_id=tenant.id, prefix=prefix, key_hash=keys.hash_key(secret), name=name, role=role
        )
        self.session.add(key)
        await self.session.flush()
        await self._audit(
            "key.create", f"key:{prefix}", tenant.id, key_id=key.id, name=name, role=str(role)
        )
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
        return found(
            result.scalar_one_or_none(), f"no API key with id or prefix {key_id_or_prefix!r}"
        )

    async def set_limits(
        self, key_id_or_prefix: str, limits: LimitSet | Callable[[LimitSet], LimitSet]
    ) -> ApiKey:
        """Override the plan's limits for one key: with `limits`, or `limits(current)`."""
        key = await self.get(key_id_or_prefix)
        current = LimitSet.of(key)
        before = _limits_view(current)
        if callable(limits):
            limits = limits(current)
        limits.apply_to(key)
        changes = _changes(before, _limits_view(limits))
        await self._audit("key.set_limits", f"key:{key.prefix}", key.tenant_id, changes=changes)
        await keys_changed(self.session)
        return key

    async def revoke(self, key_id_or_prefix: str) -> ApiKey:
        key = await self.get(key_id_or_prefix)
        if key.status != KeyStatus.REVOKED:
            key.status = KeyStatus.REVOKED
            key.revoked_at = utcnow()
            await self._audit("key.revoke", f"key:{key.prefix}", key.tenant_id, key_id=key.id)
            await keys_changed(self.session)
        return key

    async def authenticate(
        self, secret: str, now: datetime | None = None, context: AuditContext | None = None
    ) -> Principal | None:
        """The caller behind `secret`, or None for an unknown, malformed or revoked key.
        A revoked key presented with its right secret is a security event: audited, at most
        once a minute per key."""
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
        if not keys.matches(secret, key.key_hash):
            return None
        if key.status != KeyStatus.ACTIVE:
            await audit.record(
                self.session,
                actor=f"key:{key.prefix}",
                action="auth.revoked_key",
                target=f"key:{key.prefix}",
                tenant_id=key.tenant_id,
                details={"key_id": key.id},
                context=context,
                unless_within=REVOKED_KEY_AUDIT_INTERVAL,
            )
            return None
        now = now or utcnow()
        last_used = None if key.last_used_at is None else as_utc(key.last_used_at)
        if last_used is None or now - last_used >= LAST_USED_GRANULARITY:
            key.last_used_at = now  # one write a minute per key, not one per request
        return Principal.of(key, tenant_name, plan)

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
        """The ledger row and, when it costs something, its Stripe outbox row."""
        await ledger.record(self.session, event)

    async def for_tenant(self, tenant_id: str, limit: int = 100) -> list[UsageEvent]:
        return await ledger.tenant_rows(self.session, tenant_id, limit)
