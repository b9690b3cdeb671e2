"""/admin/api: plans, tenants, keys, quota usage and the model registry, for
administrators (admin keys)."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, delete, get, patch, post
from litestar.di import NamedDependency, Provide
from litestar.params import FromPath
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.admin.schemas import (
    KeyBody,
    LimitsBody,
    ModelBody,
    ModelPatch,
    PlanBody,
    TenantBody,
    TenantPatch,
    key_view,
    plan_view,
    tenant_view,
)
from gateway.admission.auth import audit_context, authenticate, note_failure
from gateway.api.schemas import decode
from gateway.deps import month_usage
from gateway.errors import InvalidRequest, PermissionDenied
from gateway.openapi import ADMIN, ADMIN_WRITE, documented
from gateway.openapi.shapes import CreatedKey, Key, Plan, ServedModel, Tenant, TenantQuota
from gateway.runtime import Runtime
from tenants.audit import Actor
from tenants.limits import PlanTerms
from tenants.models import KeyRole
from tenants.quota import QuotaStore
from tenants.registry import ModelService, model_view
from tenants.services import ApiKeyService, PlanService, Principal, TenantService


async def require_admin(
    request: Request[Any, Any, Any], runtime: NamedDependency[Runtime]
) -> Principal:
    principal = await authenticate(request, runtime)
    if principal.role != KeyRole.ADMIN:
        note_failure(request, runtime, principal.key_prefix, "admin_required")
        raise PermissionDenied("this needs an admin key", code="admin_required")
    return principal


async def admin_actor(request: Request[Any, Any, Any], admin: NamedDependency[Principal]) -> Actor:
    """The admin key and request behind a change, for the audit log."""
    return Actor(admin.actor, audit_context(request))


class AdminController(Controller):
    path = "/admin/api"
    tags = ["Admin"]
    dependencies = {"admin": Provide(require_admin), "actor": Provide(admin_actor)}

    @get("/plans", operation_class=documented(list[Plan], errors=ADMIN))
    async def list_plans(
        self, db_session: NamedDependency[AsyncSession], admin: NamedDependency[Principal]
    ) -> list[dict[str, Any]]:
        return [plan_view(plan) for plan in await PlanService(db_session).list()]

    @post(
        "/plans",
        status_code=201,
        operation_class=documented(Plan, body=PlanBody, status=201, errors=ADMIN_WRITE),
    )
    async def create_plan(
        self,
        request: Request[Any, Any, Any],
        db_session: NamedDependency[AsyncSession],
        actor: NamedDependency[Actor],
    ) -> dict[str, Any]:
        body = decode(await request.body(), PlanBody)
        if not isinstance(body.name, str):
            raise InvalidRequest("a plan needs a name", param="name")
        plan = await PlanService(db_session, actor).create(body.name, body.terms(PlanTerms()))
        return plan_view(plan)

    @patch(
        "/plans/{name:str}",
        operation_class=documented(Plan, body=PlanBody, errors=ADMIN_WRITE),
    )
    async def update_plan(
        self,
        name: FromPath[str],
        request: Request[Any, Any, Any],
        db_session: NamedDependency[AsyncSession],
        actor: NamedDependency[Actor],
    ) -> dict[str, Any]:
        body = decode(await request.body(), PlanBody)
        return plan_view(await PlanService(db_session, actor).update(name, body.terms))

    @get("/tenants", operation_class=documented(list[Tenant], errors=ADMIN))
    async def list_tenants(
        self, db_session: NamedDependency[AsyncSession], admin: NamedDependency[Principal]
    ) -> list[dict[str, Any]]:
        plans = {plan.id: plan.name for plan in await PlanService(db_session).list()}
        tenants = await TenantService(db_session).list()
        return [tenant_view(t, plans.get(t.plan_id or "")) for t in tenants]

    @post(
        "/tenants",
        status_code=201,
        operation_class=documented(Tenant, body=TenantBody, status=201, errors=ADMIN_WRITE),
    )
    async def create_tenant(
        self,
        request: Request[Any, Any, Any],
        db_session: NamedDependency[AsyncSession],
        actor: NamedDependency[Actor],
    ) -> dict[str, Any]:
        body = decode(await request.body(), TenantBody)
        tenant = await TenantService(db_session, actor).create(body.name, body.plan)
        return tenant_view(tenant, body.plan)

    @patch(
        "/tenants/{name:str}",
        operation_class=documented(Tenant, body=TenantPatch, errors=ADMIN_WRITE),
    )
    async def update_tenant(
        self,
        name: FromPath[str],
        request: Request[Any, Any, Any],
        db_session: NamedDependency[AsyncSession],
        actor: NamedDependency[Actor],
    ) -> dict[str, Any]:
        body = decode(await request.body(), TenantPatch)
        tenant = await TenantService(db_session, actor).set_plan(name, body.plan)
        return tenant_view(tenant, body.plan)

    @get("/tenants/{name:str}/usage", operation_class=documented(TenantQuota, errors=ADMIN))
    async def tenant_usage(
        self,
        name: FromPath[str],
        db_session: NamedDependency[AsyncSession],
        quota_store: NamedDependency[QuotaStore],
        admin: NamedDependency[Principal],
    ) -> dict[str, Any]:
        tenant = await TenantService(db_session).get(name)
        period, usage = await month_usage(quota_store, tenant.id)
        return {
            "tenant": tenant.name,
            "period": period,
            "spent_micros": usage.spent_micros,
            "reserved_micros": usage.reserved_micros,
            "concurrent": usage.concurrent,
            "requests_last_minute": usage.requests_in_window,
            "tokens_last_minute": usage.tokens_in_window,
        }

    @get("/tenants/{name:str}/keys", operation_class=documented(list[Key], errors=ADMIN))
    async def list_keys(
        self,
        name: FromPath[str],
        db_session: NamedDependency[AsyncSession],
        admin: NamedDependency[Principal],
    ) -> list[dict[str, Any]]:
        tenant = await TenantService(db_session).get(name)
        return [key_view(key) for key, _ in await ApiKeyService(db_session).list(tenant)]

    @post(
        "/tenants/{name:str}/keys",
        status_code=201,
        operation_class=documented(CreatedKey, body=KeyBody, status=201, errors=ADMIN_WRITE),
    )
    async def create_key(
        self,
        name: FromPath[str],
        request: Request[Any, Any, Any],
        db_session: NamedDependency[AsyncSession],
        actor: NamedDependency[Actor],
    ) -> dict[str, Any]:
        body = decode(await request.body() or b"{}", KeyBody)
        role = KeyRole.ADMIN if body.admin else KeyRole.TENANT
        tenant = await TenantService(db_session).get(name)
        created = await ApiKeyService(db_session, actor).create(tenant, body.name, role)
        return {**key_view(created.key), "key": created.secret}  # shown this once

    @post(
        "/keys/{key:str}/revoke",
        status_code=200,
        operation_class=documented(Key, errors=ADMIN_WRITE),
    )
    async def revoke_key(
        self,
        key: FromPath[str],
        db_session: NamedDependency[AsyncSession],
        actor: NamedDependency[Actor],
    ) -> dict[str, Any]:
        return key_view(await ApiKeyService(db_session, actor).revoke(key))

    @patch(
        "/keys/{key:str}/limits",
        operation_class=documented(Key, body=LimitsBody, errors=ADMIN_WRITE),
    )
    async def set_key_limits(
        self,
        key: FromPath[str],
        request: Request[Any, Any, Any],
        db_session: NamedDependency[AsyncSession],
        actor: NamedDependency[Actor],
    ) -> dict[str, Any]:
        body = decode(await request.body(), LimitsBody)
        return key_view(await ApiKeyService(db_session, actor).set_limits(key, body.merged))

    # Models: every gateway replica serves a change within a few seconds (the directory's
    # refresh), so nothing here touches this replica's clients. `path`: names may hold '/'.
    @get("/models", operation_class=documented(list[ServedModel], errors=ADMIN))
    async def list_models(
        self, db_session: NamedDependency[AsyncSession], admin: NamedDependency[Principal]
    ) -> list[dict[str, Any]]:
        return [model_view(row) for row in await ModelService(db_session).list()]

    @get("/models/{name:path}", operation_class=documented(ServedModel, errors=ADMIN))
    async def get_model(
        self,
        name: FromPath[str],
        db_session: NamedDependency[AsyncSession],
        admin: NamedDependency[Principal],
    ) -> dict[str, Any]:
        return model_view(await ModelService(db_session).get(name.lstrip("/")))

    @post(
        "/models",
        status_code=201,
        operation_class=documented(ServedModel, body=ModelBody, status=201, errors=ADMIN_WRITE),
    )
    async def create_model(
        self,
        request: Request[Any, Any, Any],
        db_session: NamedDependency[AsyncSession],
        actor: NamedDependency[Actor],
    ) -> dict[str, Any]:
        body = decode(await request.body(), ModelBody)
        return model_view(await ModelService(db_session, actor).add(body.spec()))

    @patch(
        "/models/{name:path}",
        operation_class=documented(ServedModel, body=ModelPatch, errors=ADMIN_WRITE),
    )
    async def update_model(
        self,
        name: FromPath[str],
        request: Request[Any, Any, Any],
        db_session: NamedDependency[AsyncSession],
        actor: NamedDependency[Actor],
    ) -> dict[str, Any]:
        changes = decode(await request.body(), ModelPatch).changes()
        if not changes:
            raise InvalidRequest("nothing to change: give at least one field")
        row = await ModelService(db_session, actor).update(name.lstrip("/"), **changes)
        return model_view(row)

    @delete(
        "/models/{name:path}",
        status_code=204,
        operation_class=documented(None, status=204, errors=ADMIN_WRITE),
    )
    async def remove_model(
        self,
        name: FromPath[str],
        db_session: NamedDependency[AsyncSession],
        actor: NamedDependency[Actor],
    ) -> None:
        await ModelService(db_session, actor).remove(name.lstrip("/"))
