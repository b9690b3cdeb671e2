"""/admin/api: plans, tenants, keys and quota usage, for administrators (admin keys)."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, get, patch, post
from litestar.di import NamedDependency, Provide
from litestar.params import FromPath

from gateway.admin.schemas import (
    KeyBody,
    LimitsBody,
    PlanBody,
    TenantBody,
    TenantPatch,
    key_view,
    plan_view,
    tenant_view,
)
from gateway.admission.auth import audit_context, authenticate, note_failure
from gateway.api.schemas import decode
from gateway.errors import InvalidRequest, PermissionDenied
from gateway.runtime import Runtime
from tenants.audit import Actor
from tenants.limits import LimitSet, PlanTerms
from tenants.models import KeyRole
from tenants.quota import month_period
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
    dependencies = {"admin": Provide(require_admin), "actor": Provide(admin_actor)}

    @get("/plans")
    async def list_plans(
        self, runtime: NamedDependency[Runtime], admin: NamedDependency[Principal]
    ) -> list[dict[str, Any]]:
        async with runtime.sessions() as session:
            return [plan_view(plan) for plan in await PlanService(session).list()]

    @post("/plans", status_code=201)
    async def create_plan(
        self,
        request: Request[Any, Any, Any],
        runtime: NamedDependency[Runtime],
        actor: NamedDependency[Actor],
    ) -> dict[str, Any]:
        body = decode(await request.body(), PlanBody)
        if not isinstance(body.name, str):
            raise InvalidRequest("a plan needs a name", param="name")
        async with runtime.sessions.begin() as session:
            plan = await PlanService(session, actor).create(body.name, body.terms(PlanTerms()))
            return plan_view(plan)

    @patch("/plans/{name:str}")
    async def update_plan(
        self,
        name: FromPath[str],
        request: Request[Any, Any, Any],
        runtime: NamedDependency[Runtime],
        actor: NamedDependency[Actor],
    ) -> dict[str, Any]:
        body = decode(await request.body(), PlanBody)
        async with runtime.sessions.begin() as session:
            service = PlanService(session, actor)
            current = PlanTerms.of(await service.get(name))
            return plan_view(await service.update(name, body.terms(current)))

    @get("/tenants")
    async def list_tenants(
        self, runtime: NamedDependency[Runtime], admin: NamedDependency[Principal]
    ) -> list[dict[str, Any]]:
        async with runtime.sessions() as session:
            plans = {plan.id: plan.name for plan in await PlanService(session).list()}
            tenants = await TenantService(session).list()
            return [tenant_view(t, plans.get(t.plan_id or "")) for t in tenants]

    @post("/tenants", status_code=201)
    async def create_tenant(
        self,
        request: Request[Any, Any, Any],
        runtime: NamedDependency[Runtime],
        actor: NamedDependency[Actor],
    ) -> dict[str, Any]:
        body = decode(await request.body(), TenantBody)
        async with runtime.sessions.begin() as session:
            service = TenantService(session, actor)
            tenant = await service.create(body.name)
            if body.plan is not None:
                await service.set_plan(tenant.name, body.plan)
            return tenant_view(tenant, body.plan)

    @patch("/tenants/{name:str}")
    async def update_tenant(
        self,
        name: FromPath[str],
        request: Request[Any, Any, Any],
        runtime: NamedDependency[Runtime],
        actor: NamedDependency[Actor],
    ) -> dict[str, Any]:
        body = decode(await request.body(), TenantPatch)
        async with runtime.sessions.begin() as session:
            tenant = await TenantService(session, actor).set_plan(name, body.plan)
            return tenant_view(tenant, body.plan)

    @get("/tenants/{name:str}/usage")
    async def tenant_usage(
        self,
        name: FromPath[str],
        runtime: NamedDependency[Runtime],
        admin: NamedDependency[Principal],
    ) -> dict[str, Any]:
        async with runtime.sessions() as session:
            tenant = await TenantService(session).get(name)
        period = month_period()
        usage = await runtime.admission.store.usage(f"tenant:{tenant.id}", period)
        return {
            "tenant": tenant.name,
            "period": period,
            "spent_micros": usage.spent_micros,
            "reserved_micros": usage.reserved_micros,
            "concurrent": usage.concurrent,
            "requests_last_minute": usage.requests_in_window,
            "tokens_last_minute": usage.tokens_in_window,
        }

    @get("/tenants/{name:str}/keys")
    async def list_keys(
        self,
        name: FromPath[str],
        runtime: NamedDependency[Runtime],
        admin: NamedDependency[Principal],
    ) -> list[dict[str, Any]]:
        async with runtime.sessions() as session:
            tenant = await TenantService(session).get(name)
            return [key_view(key) for key, _ in await ApiKeyService(session).list(tenant)]

    @post("/tenants/{name:str}/keys", status_code=201)
    async def create_key(
        self,
        name: FromPath[str],
        request: Request[Any, Any, Any],
        runtime: NamedDependency[Runtime],
        actor: NamedDependency[Actor],
    ) -> dict[str, Any]:
        body = decode(await request.body() or b"{}", KeyBody)
        role = KeyRole.ADMIN if body.admin else KeyRole.TENANT
        async with runtime.sessions.begin() as session:
            tenant = await TenantService(session).get(name)
            created = await ApiKeyService(session, actor).create(tenant, body.name, role)
            return {**key_view(created.key), "key": created.secret}  # shown this once

    @post("/keys/{key:str}/revoke", status_code=200)
    async def revoke_key(
        self,
        key: FromPath[str],
        runtime: NamedDependency[Runtime],
        actor: NamedDependency[Actor],
    ) -> dict[str, Any]:
        async with runtime.sessions.begin() as session:
            return key_view(await ApiKeyService(session, actor).revoke(key))

    @patch("/keys/{key:str}/limits")
    async def set_key_limits(
        self,
        key: FromPath[str],
        request: Request[Any, Any, Any],
        runtime: NamedDependency[Runtime],
        actor: NamedDependency[Actor],
    ) -> dict[str, Any]:
        body = decode(await request.body(), LimitsBody)
        async with runtime.sessions.begin() as session:
            service = ApiKeyService(session, actor)
            current = LimitSet.of(await service.get(key))
            return key_view(await service.set_limits(key, body.merged(current)))
