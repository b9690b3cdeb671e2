"""Admin API bodies and views."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct

from gateway.openapi import shaped
from gateway.openapi.shapes import Key
from tenants.limits import (
    LIMIT_NAMES,
    LOWEST_PRIORITY,
    MAX_BYTES,
    MAX_MICROS,
    MAX_WHOLE,
    LimitSet,
    PlanTerms,
)
from tenants.models import ApiKey, Plan, Tenant
from tenants.registry import ModelKind, ModelSpec, Target

# Bounded as the columns they are stored in (SQLite refuses an integer past 64 bits).
Limit = Annotated[int, Meta(ge=0, le=MAX_WHOLE)] | None
Budget = Annotated[int, Meta(ge=0, le=MAX_MICROS)] | None
Priority = Annotated[int, Meta(ge=0, le=LOWEST_PRIORITY)]
UNSET: Any = msgspec.UNSET


class LimitsBody(Struct, kw_only=True, forbid_unknown_fields=True):
    """Fields left out keep their value; null clears a limit."""

    rpm: Limit | msgspec.UnsetType = UNSET
    tpm: Limit | msgspec.UnsetType = UNSET
    max_concurrent: Limit | msgspec.UnsetType = UNSET
    monthly_budget_micros: Budget | msgspec.UnsetType = UNSET
    max_tokens_per_request: Limit | msgspec.UnsetType = UNSET

    def merged(self, current: LimitSet) -> LimitSet:
        given = {n: getattr(self, n) for n in LIMIT_NAMES if getattr(self, n) is not UNSET}
        return LimitSet(**{**{n: getattr(current, n) for n in LIMIT_NAMES}, **given})


class PlanBody(LimitsBody, kw_only=True, forbid_unknown_fields=True):
    name: str | msgspec.UnsetType = UNSET
    allowed_models: list[str] | msgspec.UnsetType | None = UNSET
    default_priority: Priority | msgspec.UnsetType = UNSET
    max_priority: Priority | msgspec.UnsetType = UNSET
    weight: Annotated[int, Meta(ge=1, le=MAX_WHOLE)] | msgspec.UnsetType = UNSET
    max_batch_tokens: Annotated[int, Meta(ge=0, le=MAX_WHOLE)] | msgspec.UnsetType | None = UNSET
    max_file_bytes: Annotated[int, Meta(ge=0, le=MAX_BYTES)] | msgspec.UnsetType | None = UNSET

    def terms(self, current: PlanTerms) -> PlanTerms:
        models = current.allowed_models
        if isinstance(self.allowed_models, list):
            models = frozenset(self.allowed_models)
        elif self.allowed_models is None:
            models = None
        return PlanTerms(
            name=current.name,
            limits=self.merged(current.limits),
            allowed_models=models,
            default_priority=_or(self.default_priority, current.default_priority),
            max_priority=_or(self.max_priority, current.max_priority),
            weight=_or(self.weight, current.weight),
            max_batch_tokens=_given(self.max_batch_tokens, current.max_batch_tokens),
            max_file_bytes=_given(self.max_file_bytes, current.max_file_bytes),
        )


class TenantBody(Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    plan: str | None = None


class TenantPatch(Struct, kw_only=True, forbid_unknown_fields=True):
    plan: str | None


class KeyBody(Struct, kw_only=True, forbid_unknown_fields=True):
    name: str = ""
    admin: bool = False


class TargetBody(Struct, kw_only=True, forbid_unknown_fields=True):
    url: str
    weight: int = 1


def _targets(bodies: list[TargetBody]) -> tuple[Target, ...]:
    return tuple(Target(t.url, t.weight) for t in bodies)


class ModelBody(Struct, kw_only=True, forbid_unknown_fields=True):
    """A model to add; the registry checks the values (tenants/registry.py)."""

    name: str
    kind: ModelKind
    targets: list[TargetBody]
    tokenizer: str | None = None
    upstream_model: str | None = None
    api_key_env: str | None = None  # the variable's name, never the key
    context_length: int | None = None

    def spec(self) -> ModelSpec:
        return ModelSpec(
            name=self.name,
            kind=self.kind,
            targets=_targets(self.targets),
            tokenizer=self.tokenizer,
            upstream_model=self.upstream_model,
            api_key_env=self.api_key_env,
            context_length=self.context_length,
        )


class ModelPatch(Struct, kw_only=True, forbid_unknown_fields=True):
    """Fields left out keep their value; null clears an optional one."""

    kind: ModelKind | msgspec.UnsetType = UNSET
    targets: list[TargetBody] | msgspec.UnsetType = UNSET
    tokenizer: str | msgspec.UnsetType | None = UNSET
    upstream_model: str | msgspec.UnsetType | None = UNSET
    api_key_env: str | msgspec.UnsetType | None = UNSET
    context_length: int | msgspec.UnsetType | None = UNSET

    def changes(self) -> dict[str, Any]:
        given = {f: getattr(self, f) for f in self.__struct_fields__}
        changes = {f: v for f, v in given.items() if v is not UNSET}
        if isinstance(self.targets, list):
            changes["targets"] = _targets(self.targets)
        return changes


def _or(value: Any, default: int) -> int:
    return default if value is UNSET else int(value)


def _given(value: int | msgspec.UnsetType | None, current: int | None) -> int | None:
    """A nullable field: unset keeps `current`, null clears it."""
    return current if isinstance(value, msgspec.UnsetType) else value


def plan_view(plan: Plan) -> dict[str, Any]:
    terms = PlanTerms.of(plan)
    return {
        "name": plan.name,
        **{name: getattr(terms.limits, name) for name in LIMIT_NAMES},
        "allowed_models": None if terms.allowed_models is None else sorted(terms.allowed_models),
        "default_priority": terms.default_priority,
        "max_priority": terms.max_priority,
        "weight": terms.weight,
        "max_batch_tokens": terms.max_batch_tokens,
        "max_file_bytes": terms.max_file_bytes,
    }


def tenant_view(tenant: Tenant, plan_name: str | None) -> dict[str, Any]:
    return {
        "id": tenant.id,
        "name": tenant.name,
        "plan": plan_name,
        "created_at": tenant.created_at.isoformat(),
    }


def key_view(key: ApiKey) -> dict[str, Any]:
    return shaped(
        Key,
        key,
        created_at=key.created_at.isoformat(),
        last_used_at=key.last_used_at.isoformat() if key.last_used_at else None,
        limits={name: getattr(key, name) for name in LIMIT_NAMES},
    )
