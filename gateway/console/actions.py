"""Console form posts. Each checks the CSRF token and the owner role (`action`), then
calls the same services as the admin API and the CLI, with the administrator as the audit
actor, and redirects back with a notice (post/redirect/get)."""

from __future__ import annotations

from decimal import Decimal, InvalidOperation
from typing import Any
from urllib.parse import quote

from litestar import Controller, Response, post
from litestar.datastructures import FormMultiDict
from litestar.di import NamedDependency
from litestar.params import FromPath

from gateway.console.context import ConsoleAction
from gateway.console.render import or_back_to
from tenants.admins import AdminService
from tenants.errors import InvalidInputError
from tenants.limits import LIMIT_NAMES, MAX_BYTES, MAX_MICROS, MAX_WHOLE, LimitSet, PlanTerms
from tenants.models import KeyRole
from tenants.services import ApiKeyService, PlanService, TenantService

PLAN_FIELDS = ("default_priority", "max_priority", "weight")
MIB = 2**20


def whole_number(form: FormMultiDict, name: str) -> int | None:
    """A blank field is "unlimited"; anything else must be a whole number >= 0."""
    raw = str(form.get(name, "")).strip()
    if not raw:
        return None
    if not (raw.isascii() and raw.isdigit()) or int(raw) > MAX_WHOLE:
        raise InvalidInputError(
            f"{name.replace('_', ' ')} must be a whole number up to {MAX_WHOLE:,}, or blank"
        )
    return int(raw)


def micro_dollars(raw: str, what: str) -> int:
    """An amount in dollars ("25.50") as integer micro-dollars: money is never a float."""
    try:
        micros = Decimal(raw) * 1_000_000
    except InvalidOperation:
        raise InvalidInputError(f"{what} must be an amount like 25.50, not {raw!r}") from None
    if not micros.is_finite() or micros < 0 or micros != micros.to_integral_value():
        raise InvalidInputError(f"{what} must be an amount >= 0 with at most 6 decimals")
    if micros > MAX_MICROS:
        raise InvalidInputError(f"{what} is more than {MAX_MICROS // 1_000_000:,} dollars")
    return int(micros)


def budget_micros(form: FormMultiDict) -> int | None:
    """The monthly budget; blank is unlimited."""
    raw = str(form.get("monthly_budget", "")).strip()
    return micro_dollars(raw, "budget") if raw else None


def limits_from(form: FormMultiDict) -> LimitSet:
    values = {
        name: whole_number(form, name) for name in LIMIT_NAMES if name != "monthly_budget_micros"
    }
    return LimitSet(monthly_budget_micros=budget_micros(form), **values)


def file_mib(form: FormMultiDict) -> int | None:
    """The plan's cap on a tenant's stored files, given in MiB; blank: the default."""
    raw = str(form.get("max_file_mib", "")).strip()
    if not raw:
        return None
    if not (raw.isascii() and raw.isdigit()) or int(raw) * MIB > MAX_BYTES:
        raise InvalidInputError(
            f"stored files must be a whole number of MiB up to {MAX_BYTES // MIB:,}, or blank"
        )
    return int(raw) * MIB


def terms_from(form: FormMultiDict, current: PlanTerms) -> PlanTerms:
    models_text = str(form.get("allowed_models", "")).strip()
    models = [m.strip() for m in models_text.split(",") if m.strip()]
    numbers = {name: whole_number(form, name) for name in PLAN_FIELDS}
    return PlanTerms(
        name=current.name,
        limits=limits_from(form),
        allowed_models=frozenset(models) if models else None,
        default_priority=_or(numbers["default_priority"], current.default_priority),
        max_priority=_or(numbers["max_priority"], current.max_priority),
        weight=_or(numbers["weight"], current.weight),
        max_batch_tokens=whole_number(form, "max_batch_tokens"),
        max_file_bytes=file_mib(form),
    )


def _or(value: int | None, default: int) -> int:
    return default if value is None else value


class ActionsController(Controller):
    """Every route here changes state: CSRF-checked, owners only, audited by the services."""

    path = "/"

    @post("/tenants")
    async def create_tenant(self, action: NamedDependency[ConsoleAction]) -> Response[Any]:
        name, plan = action.field("name"), action.field("plan") or None
        with or_back_to("/admin/tenants"):
            await TenantService(action.db, action.actor).create(name, plan)
        return action.back(f"/admin/tenants/{quote(name)}", f"Created tenant {name}.")

    @post("/tenants/{name:str}/plan")
    async def set_plan(
        self, name: FromPath[str], action: NamedDependency[ConsoleAction]
    ) -> Response[Any]:
        plan = action.field("plan") or None
        here = f"/admin/tenants/{quote(name)}"
        with or_back_to(here):
            await TenantService(action.db, action.actor).set_plan(name, plan)
        return action.back(here, f"{name} is now on plan {plan or 'none (unlimited)'}.")

    @post("/tenants/{name:str}/keys")
    async def create_key(
        self, name: FromPath[str], action: NamedDependency[ConsoleAction]
    ) -> Response[Any]:
        """Renders the secret in this response, once; it is never stored or redirected."""
        role = KeyRole.ADMIN if action.form.get("admin") == "on" else KeyRole.TENANT
        with or_back_to(f"/admin/tenants/{quote(name)}"):
            tenant = await TenantService(action.db, action.actor).get(name)
            created = await ApiKeyService(action.db, action.actor).create(
                tenant, action.field("key_name")[:100], role
            )
        return action.render(
            "key_created.html",
            status_code=201,
            title="Key created",
            tenant=tenant,
            key=created.key,
            secret=created.secret,
        )

    @post("/keys/{key:str}/revoke")
    async def revoke_key(
        self, key: FromPath[str], action: NamedDependency[ConsoleAction]
    ) -> Response[Any]:
        back = action.field("back")
        here = back if back.startswith("/admin/") else "/admin/keys"
        with or_back_to(here):
            revoked = await ApiKeyService(action.db, action.actor).revoke(key)
        return action.back(here, f"Revoked key {revoked.prefix}.")

    @post("/admins")
    async def create_admin(self, action: NamedDependency[ConsoleAction]) -> Response[Any]:
        email = action.field("email")
        with or_back_to("/admin/admins"):
            admin = await AdminService(action.db, action.actor).create(
                email, action.field("role"), str(action.form.get("password", ""))
            )
        return action.back("/admin/admins", f"Added {admin.role} {admin.email}.")

    @post("/plans")
    async def create_plan(self, action: NamedDependency[ConsoleAction]) -> Response[Any]:
        name = action.field("name")
        with or_back_to("/admin/plans"):
            terms = terms_from(action.form, PlanTerms())
            await PlanService(action.db, action.actor).create(name, terms)
        return action.back("/admin/plans", f"Created plan {name}.")

    @post("/plans/{name:str}")
    async def update_plan(
        self, name: FromPath[str], action: NamedDependency[ConsoleAction]
    ) -> Response[Any]:
        with or_back_to("/admin/plans"):
            await PlanService(action.db, action.actor).update(
                name, lambda current: terms_from(action.form, current)
            )
        return action.back("/admin/plans", f"Saved plan {name}.")
