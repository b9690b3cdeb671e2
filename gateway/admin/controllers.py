"""/admin/api: plans, tenants, keys, quota usage and the model registry, for
administrators (admin keys)."""

from __future__ import annotations

from typing import Any, TypeVar

from litestar import Controller, Request, delete, get, patch, post
from litestar.di import NamedDependency, Provide
from litestar.params import FromPath, RawBody
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
from gateway.admission.authentication import KeyAuthentication
from gateway.api.schemas import decode
from gateway.core.errors import InvalidRequest, PermissionDenied
from gateway.dispatch.directory import ModelDirectory
from gateway.dispatch.upstream import OpenAIUpstreamClient
from gateway.http.auth import audit_context, authenticate, note_failure
from gateway.http.deps import month_usage
from gateway.openapi import ADMIN, ADMIN_WRITE, route
from gateway.openapi.shapes import CreatedKey, Key, Plan, ServedModel, Tenant, TenantQuota
from tenants.audit import Actor, Audited
from tenants.limits import PlanTerms
from tenants.models import KeyRole
from tenants.quota import QuotaStore
from tenants.registry import ModelService, model_view
from tenants.registry import ServedModel as RegistryRow
from tenants.services import ApiKeyService, PlanService, Principal, TenantService

S = TypeVar("S", bound=Audited)


async def require_admin(
    request: Request[Any, Any, Any], authentication: NamedDependency[KeyAuthentication]
) -> Principal:
    principal = await authenticate(request, authentication)
    if principal.role != KeyRole.ADMIN:
        note_failure(request, authentication, principal.key_prefix, "admin_required")
        raise PermissionDenied("this needs an admin key", code="admin_required")
    return principal


async def admin_actor(request: Request[Any, Any, Any], admin: NamedDependency[Principal]) -> Actor:
    """The admin key and request behind a change, for the audit log."""
    return Actor(admin.actor, audit_context(request))


def audited(service: type[S]) -> Provide:
    """A handler's service, in the request's transaction, auditing the calling admin."""

    def provide(db_session: NamedDependency[AsyncSession], actor: NamedDependency[Actor]) -> S:
        return service(db_session, actor)

    return Provide(provide, sync_to_thread=False)


def admin_dependencies(**services: type[Audited]) -> dict[str, Provide]:
    """An admin controller's dependencies: the calling key (refused unless an admin key),
    its actor for the audit log, and each of `services`, by its handlers' parameter name,
    in the request's transaction, auditing that actor (see `audited`)."""
    return {
        "admin": Provide(require_admin),
        "actor": Provide(admin_actor),
        **{name: audited(service) for name, service in services.items()},
    }


def served(row: RegistryRow, directory: ModelDirectory) -> dict[str, Any]:
    """A registry model, with its upstreams' health as this replica sees them (an
    upstream that claimed more usage than was reserved is `suspect`)."""
    client = directory.built(row.name)
    upstreams = client.upstreams() if isinstance(client, OpenAIUpstreamClient) else []
    return {**model_view(row), "upstreams": upstreams}


class AdminController(Controller):
    path = "/admin/api"
    tags = ["Admin"]
    dependencies = admin_dependencies(
        plans=PlanService, tenants=TenantService, keys=ApiKeyService, models=ModelService
    )

    @route(get, "/plans", list[Plan], errors=ADMIN)
    async def list_plans(self, plans: NamedDependency[PlanService]) -> list[dict[str, Any]]:
        return [plan_view(plan) for plan in await plans.list()]

    @route(post, "/plans", Plan, body=PlanBody, status=201, errors=ADMIN_WRITE)
    async def create_plan(
        self, body: RawBody, plans: NamedDependency[PlanService]
    ) -> dict[str, Any]:
        plan = decode(body, PlanBody)
        if not isinstance(plan.name, str):
            raise InvalidRequest("a plan needs a name", param="name")
        return plan_view(await plans.create(plan.name, plan.terms(PlanTerms())))

    @route(patch, "/plans/{name:str}", Plan, body=PlanBody, errors=ADMIN_WRITE)
    async def update_plan(
        self, name: FromPath[str], body: RawBody, plans: NamedDependency[PlanService]
    ) -> dict[str, Any]:
        return plan_view(await plans.update(name, decode(body, PlanBody).terms))

    @route(get, "/tenants", list[Tenant], errors=ADMIN)
    async def list_tenants(
        self, plans: NamedDependency[PlanService], tenants: NamedDependency[TenantService]
    ) -> list[dict[str, Any]]:
        names = {plan.id: plan.name for plan in await plans.list()}
        return [tenant_view(t, names.get(t.plan_id or "")) for t in await tenants.list()]

    @route(post, "/tenants", Tenant, body=TenantBody, status=201, errors=ADMIN_WRITE)
    async def create_tenant(
        self, body: RawBody, tenants: NamedDependency[TenantService]
    ) -> dict[str, Any]:
        new = decode(body, TenantBody)
        return tenant_view(await tenants.create(new.name, new.plan), new.plan)

    @route(patch, "/tenants/{name:str}", Tenant, body=TenantPatch, errors=ADMIN_WRITE)
    async def update_tenant(
        self, name: FromPath[str], body: RawBody, tenants: NamedDependency[TenantService]
    ) -> dict[str, Any]:
        plan = decode(body, TenantPatch).plan
        return tenant_view(await tenants.set_plan(name, plan), plan)

    @route(get, "/tenants/{name:str}/usage", TenantQuota, errors=ADMIN)
    async def tenant_usage(
        self,
        name: FromPath[str],
        quota_store: NamedDependency[QuotaStore],
        tenants: NamedDependency[TenantService],
    ) -> dict[str, Any]:
        tenant = await tenants.get(name)
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

    @route(get, "/tenants/{name:str}/keys", list[Key], errors=ADMIN)
    async def list_keys(
        self,
        name: FromPath[str],
        tenants: NamedDependency[TenantService],
        keys: NamedDependency[ApiKeyService],
    ) -> list[dict[str, Any]]:
        return [key_view(key) for key, _ in await keys.list(await tenants.get(name))]

    @route(
        post, "/tenants/{name:str}/keys", CreatedKey, body=KeyBody, status=201, errors=ADMIN_WRITE
    )
    async def create_key(
        self,
        name: FromPath[str],
        body: RawBody,
        tenants: NamedDependency[TenantService],
        keys: NamedDependency[ApiKeyService],
    ) -> dict[str, Any]:
        new = decode(body or b"{}", KeyBody)
        role = KeyRole.ADMIN if new.admin else KeyRole.TENANT
        created = await keys.create(await tenants.get(name), new.name, role)
        return {**key_view(created.key), "key": created.secret}  # shown this once

    @route(post, "/keys/{key:str}/revoke", Key, errors=ADMIN_WRITE)
    async def revoke_key(
        self, key: FromPath[str], keys: NamedDependency[ApiKeyService]
    ) -> dict[str, Any]:
        return key_view(await keys.revoke(key))

    @route(patch, "/keys/{key:str}/limits", Key, body=LimitsBody, errors=ADMIN_WRITE)
    async def set_key_limits(
        self, key: FromPath[str], body: RawBody, keys: NamedDependency[ApiKeyService]
    ) -> dict[str, Any]:
        return key_view(await keys.set_limits(key, decode(body, LimitsBody).merged))

    # Models: every gateway replica serves a change within a few seconds (the directory's
    # refresh), so nothing here touches this replica's clients. `path`: names may hold '/'.
    @route(get, "/models", list[ServedModel], errors=ADMIN)
    async def list_models(
        self, models: NamedDependency[ModelService], directory: NamedDependency[ModelDirectory]
    ) -> list[dict[str, Any]]:
        return [served(row, directory) for row in await models.list()]

    @route(get, "/models/{name:path}", ServedModel, errors=ADMIN)
    async def get_model(
        self,
        name: FromPath[str],
        models: NamedDependency[ModelService],
        directory: NamedDependency[ModelDirectory],
    ) -> dict[str, Any]:
        return served(await models.get(name.lstrip("/")), directory)

    @route(post, "/models", ServedModel, body=ModelBody, status=201, errors=ADMIN_WRITE)
    async def create_model(
        self, body: RawBody, models: NamedDependency[ModelService]
    ) -> dict[str, Any]:
        return {**model_view(await models.add(decode(body, ModelBody).spec())), "upstreams": []}

    @route(patch, "/models/{name:path}", ServedModel, body=ModelPatch, errors=ADMIN_WRITE)
    async def update_model(
        self, name: FromPath[str], body: RawBody, models: NamedDependency[ModelService]
    ) -> dict[str, Any]:
        changes = decode(body, ModelPatch).changes()
        if not changes:
            raise InvalidRequest("nothing to change: give at least one field")
        return {**model_view(await models.update(name.lstrip("/"), **changes)), "upstreams": []}

    @route(delete, "/models/{name:path}", None, status=204, errors=ADMIN_WRITE)
    async def remove_model(
        self, name: FromPath[str], models: NamedDependency[ModelService]
    ) -> None:
        await models.remove(name.lstrip("/"))
