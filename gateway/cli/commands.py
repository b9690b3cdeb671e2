"""`tollgate`: serve the gateway and manage the database, tenants and keys."""

from __future__ import annotations

import argparse
import getpass
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from gateway.cli import adapters as adapters_cli
from gateway.cli import backend as backend_cli
from gateway.cli import billing as billing_cli
from gateway.cli import capacity as capacity_cli
from gateway.cli import models as models_cli
from gateway.cli import quota as quota_cli
from gateway.cli.support import actor, command, group, in_session, micros, print_in_session
from gateway.settings import Settings, SettingsError, engine_knobs, gateway_engine_defaults
from tenants import audit, db
from tenants.admins import AdminService
from tenants.errors import DomainError, InvalidInputError
from tenants.limits import LIMIT_NAMES, LimitSet, PlanTerms
from tenants.models import KeyRole, Plan, as_utc
from tenants.services import ApiKeyService, PlanService, TenantService


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        settings = Settings.from_env()
        result: int = args.handler(settings, args)
    except (SettingsError, engine_knobs.KnobError, DomainError) as exc:
        print(f"tollgate: {exc}", file=sys.stderr)
        return 2
    return result


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tollgate", description=__doc__)
    commands = parser.add_subparsers(required=True, metavar="COMMAND")
    _add_serve_commands(commands)
    _add_db_commands(commands)
    _add_audit_commands(commands)
    _add_plan_commands(commands)
    _add_tenant_commands(commands)
    _add_key_commands(commands)
    _add_admin_commands(commands)
    models_cli.add_commands(commands)
    adapters_cli.add_commands(commands)
    billing_cli.add_commands(commands)
    capacity_cli.add_commands(commands)
    quota_cli.add_commands(commands)
    return parser


def _add_serve_commands(commands: Any) -> None:
    """`serve` and `backend serve`: the gateway and engine processes."""
    serve = command(commands, "serve", "run the gateway with the in-process engine", _serve)
    serve.add_argument("--host", help="interface to bind (TOLLGATE_HOST, default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (TOLLGATE_PORT, default 8000)")
    serve.add_argument("--model", type=Path, help="checkpoint folder (TOLLGATE_MODEL)")
    engine_knobs.add_flags(serve, gateway_engine_defaults())
    backend = group(commands, "backend", "inference backend replicas")
    backend_cli.add_flags(command(backend, "serve", backend_cli.HELP, backend_cli.run))


def _add_db_commands(commands: Any) -> None:
    """`db …`: the schema, and the application role."""
    database = group(commands, "db", "database schema")
    upgrade = command(database, "upgrade", "apply migrations", _db_upgrade)
    upgrade.add_argument("revision", nargs="?", default="head")
    command(database, "downgrade", "revert migrations", _db_downgrade).add_argument("revision")
    command(database, "current", "show the applied revision", _db_current)
    grant = command(
        database,
        "grant-app-role",
        "PostgreSQL: let an existing role run the gateway (no UPDATE/DELETE on the audit log)",
        _db_grant_app_role,
    )
    grant.add_argument("--role", required=True, help="the role the gateway connects as")


def _add_audit_commands(commands: Any) -> None:
    """`audit …`: verify and list the audit log."""
    audit_log = group(commands, "audit", "the tamper-evident audit log")
    verify = command(
        audit_log,
        "verify",
        "check the hash chain; exit 1 naming the first bad event",
        _audit_verify,
    )
    verify.add_argument("--anchor", type=_anchor, help="ID:HASH printed by an earlier verify")
    list_events = command(audit_log, "list", "recent events, newest first", _audit_list)
    list_events.add_argument("--tenant", help="tenant name")
    list_events.add_argument("--action", help="e.g. key.revoke, auth.failures")
    list_events.add_argument("--actor", help="e.g. key:tg-AbCd1234, cli:alice")
    list_events.add_argument("--since", type=_iso_time, help="ISO 8601 time, UTC if no zone")
    list_events.add_argument("--limit", type=int, default=50)


def _add_plan_commands(commands: Any) -> None:
    """`plans …`."""
    plans = group(commands, "plans", "plans and their limits")
    create_plan = command(plans, "create", "create a plan", _plans_create)
    create_plan.add_argument("name")
    _plan_flags(create_plan)
    update_plan = command(plans, "update", "change a plan (flags not given stay)", _plans_update)
    update_plan.add_argument("name")
    _plan_flags(update_plan)
    command(plans, "list", "list plans", _plans_list)


def _add_tenant_commands(commands: Any) -> None:
    """`tenants …`."""
    tenants = group(commands, "tenants", "tenants")
    create_tenant = command(tenants, "create", "create a tenant", _tenants_create)
    create_tenant.add_argument("name")
    create_tenant.add_argument("--plan", help="plan name (default: none, i.e. unlimited)")
    command(tenants, "list", "list tenants", _tenants_list)
    set_plan = command(
        tenants, "set-plan", "move a tenant to a plan ('none': unlimited)", _tenants_set_plan
    )
    set_plan.add_argument("name")
    set_plan.add_argument("plan")


def _add_key_commands(commands: Any) -> None:
    """`keys …`."""
    api_keys = group(commands, "keys", "API keys")
    create_key = command(api_keys, "create", "create a key (printed once)", _keys_create)
    create_key.add_argument("--tenant", required=True)
    create_key.add_argument("--name", default="")
    create_key.add_argument("--admin", action="store_true", help="may also administer")
    command(api_keys, "list", "list keys (prefixes only)", _keys_list).add_argument("--tenant")
    key_limits = command(
        api_keys,
        "limits",
        "override the plan's limits for one key ('none' clears an override)",
        _keys_limits,
    )
    key_limits.add_argument("key", help="key id or prefix")
    _limit_flags(key_limits)
    command(api_keys, "revoke", "revoke a key by id or prefix", _keys_revoke).add_argument("key")


def _add_admin_commands(commands: Any) -> None:
    """`admins …`: console administrators."""
    admins = group(commands, "admins", "console administrators")
    create_admin = command(
        admins,
        "create",
        "create a console administrator; the password comes from "
        "TOLLGATE_ADMIN_PASSWORD, else stdin when piped, else a prompt",
        _admins_create,
    )
    create_admin.add_argument("--email", required=True)
    create_admin.add_argument("--role", choices=["owner", "viewer"], default="viewer")
    command(admins, "list", "list console administrators", _admins_list)


def _optional_int(text: str) -> int | None:
    if text.lower() in ("none", "unlimited"):
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a whole number or 'none', got {text!r}"
        ) from None
    if value < 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return value


def _budget(text: str) -> int | None:
    """A monthly budget in currency units ('25.50'), stored in integer micro-units."""
    if text.lower() in ("none", "unlimited"):
        return None
    return micros(text, "25.50", "budget")


_UNSET = object()  # a flag that was not given: keep the current value
PLAN_CAPS = ("max_batch_tokens", "max_file_bytes")  # a plan's caps beside its limits


def _limit_flags(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--rpm", type=_optional_int, default=_UNSET, help="requests per minute")
    add("--tpm", type=_optional_int, default=_UNSET, help="tokens (in + out) per minute")
    add("--concurrency", dest="max_concurrent", type=_optional_int, default=_UNSET)
    add(
        "--budget",
        dest="monthly_budget_micros",
        type=_budget,
        default=_UNSET,
        help="monthly budget in currency units, e.g. 25.00",
    )
    add("--max-tokens", dest="max_tokens_per_request", type=_optional_int, default=_UNSET)


def _plan_flags(parser: argparse.ArgumentParser) -> None:
    _limit_flags(parser)
    add = parser.add_argument
    add("--models", default=_UNSET, help="comma-separated allowed models, or 'all'")
    add("--default-priority", type=int, default=_UNSET)
    add("--max-priority", type=int, default=_UNSET, help="most urgent priority allowed (0-9)")
    add("--weight", type=int, default=_UNSET, help="share of capacity under contention")
    add(
        "--max-batch-tokens",
        type=_optional_int,
        default=_UNSET,
        help="worst-case tokens of a tenant's unfinished batches ('none': no cap)",
    )
    add(
        "--max-file-bytes",
        type=_optional_int,
        default=_UNSET,
        help="a tenant's stored files, in bytes ('none': TOLLGATE_FILES_MAX_BYTES_PER_TENANT)",
    )


def _limits_from(args: argparse.Namespace, current: LimitSet) -> LimitSet:
    given = {n: getattr(args, n) for n in LIMIT_NAMES if getattr(args, n) is not _UNSET}
    return replace(current, **given)


def _terms_from(args: argparse.Namespace, current: PlanTerms) -> PlanTerms:
    changes: dict[str, object] = {"limits": _limits_from(args, current.limits)}
    if args.models is not _UNSET:
        names = [m.strip() for m in args.models.split(",") if m.strip()]
        changes["allowed_models"] = None if args.models == "all" else frozenset(names)
    for name in ("default_priority", "max_priority", "weight", *PLAN_CAPS):
        if getattr(args, name) is not _UNSET:
            changes[name] = getattr(args, name)
    return replace(current, **changes)  # type: ignore[arg-type]


def _describe_plan(plan: Plan) -> str:
    terms = PlanTerms.of(plan)
    limits = ", ".join(
        f"{name}={'-' if getattr(terms.limits, name) is None else getattr(terms.limits, name)}"
        for name in LIMIT_NAMES
    )
    models = "all" if terms.allowed_models is None else ",".join(sorted(terms.allowed_models))
    return (
        f"{plan.name}\t{limits}\tmodels={models}\tpriority={terms.default_priority} "
        f"(max {terms.max_priority})\tweight={terms.weight}\t"
        + "\t".join(f"{name}={_shown(getattr(terms, name))}" for name in PLAN_CAPS)
    )


def _shown(value: int | None) -> str:
    return "-" if value is None else str(value)


def _iso_time(text: str) -> datetime:
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an ISO 8601 time, got {text!r}") from None
    return as_utc(moment)


def _anchor(text: str) -> audit.Anchor:
    try:
        return audit.Anchor.parse(text)
    except DomainError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _serve(settings: Settings, args: argparse.Namespace) -> int:
    from gateway.cli.serve import serve

    engine = engine_knobs.from_flags(settings.engine, args)
    settings = settings.with_overrides(
        host=args.host, port=args.port, model_path=args.model, engine=engine
    )
    return serve(settings)


def _db_upgrade(settings: Settings, args: argparse.Namespace) -> int:
    db.upgrade(settings.database_url, args.revision)
    print(f"database at {db.current_revision(settings.database_url)}")
    return 0


def _db_downgrade(settings: Settings, args: argparse.Namespace) -> int:
    db.downgrade(settings.database_url, args.revision)
    print(f"database at {db.current_revision(settings.database_url)}")
    return 0


def _db_current(settings: Settings, args: argparse.Namespace) -> int:
    print(db.current_revision(settings.database_url) or "empty (run `tollgate db upgrade`)")
    return 0


def _db_grant_app_role(settings: Settings, args: argparse.Namespace) -> int:
    for statement in audit.grant_app_role(settings.database_url, args.role):
        print(statement)
    return 0


def _audit_verify(settings: Settings, args: argparse.Namespace) -> int:
    async def work(session: AsyncSession) -> audit.Verification:
        return await audit.verify(session, args.anchor)

    result = in_session(settings, work)
    print(result.describe(), file=sys.stdout if result.ok else sys.stderr)
    return 0 if result.ok else 1


def _audit_list(settings: Settings, args: argparse.Namespace) -> int:
    async def work(session: AsyncSession) -> list[str]:
        tenant = await TenantService(session).get(args.tenant) if args.tenant else None
        events = await audit.list_events(
            session,
            tenant_id=tenant.id if tenant else None,
            action=args.action,
            actor=args.actor,
            since=args.since,
            limit=args.limit,
        )
        return ["\t".join(_event_columns(audit.event_view(event))) for event in events]

    header = "ID\tTIME\tACTOR\tACTION\tTARGET\tTENANT ID\tREQUEST ID\tIP\tDETAILS"
    print("\n".join([header, *in_session(settings, work)]))
    return 0


def _event_columns(view: dict[str, object]) -> list[str]:
    names = ("id", "time", "actor", "action", "target", "tenant_id", "request_id", "ip")
    shown = [str(view[name]) if view[name] is not None else "-" for name in names]
    return [*shown, json.dumps(view["details"], sort_keys=True)]


def _plans_create(settings: Settings, args: argparse.Namespace) -> int:
    async def work(session: AsyncSession) -> str:
        service = PlanService(session, actor())
        plan = await service.create(args.name, _terms_from(args, PlanTerms()))
        return "created plan " + _describe_plan(plan)

    return print_in_session(settings, work)


def _plans_update(settings: Settings, args: argparse.Namespace) -> int:
    async def work(session: AsyncSession) -> str:
        plan = await PlanService(session, actor()).update(
            args.name, lambda current: _terms_from(args, current)
        )
        return "updated plan " + _describe_plan(plan)

    return print_in_session(settings, work)


def _plans_list(settings: Settings, args: argparse.Namespace) -> int:
    async def work(session: AsyncSession) -> list[str]:
        return [_describe_plan(plan) for plan in await PlanService(session).list()]

    print("\n".join(in_session(settings, work)) or "no plans")
    return 0


def _tenants_set_plan(settings: Settings, args: argparse.Namespace) -> int:
    async def work(session: AsyncSession) -> str:
        plan = None if args.plan.lower() == "none" else args.plan
        tenant = await TenantService(session, actor()).set_plan(args.name, plan)
        return f"tenant {tenant.name} is on plan {plan or 'none (unlimited)'}"

    return print_in_session(settings, work)


def _keys_limits(settings: Settings, args: argparse.Namespace) -> int:
    async def work(session: AsyncSession) -> str:
        key = await ApiKeyService(session, actor()).set_limits(
            args.key, lambda current: _limits_from(args, current)
        )
        limits = LimitSet.of(key)
        shown = ", ".join(f"{n}={getattr(limits, n)}" for n in LIMIT_NAMES)
        return f"key {key.prefix}: {shown} (None: the plan's)"

    return print_in_session(settings, work)


def _tenants_create(settings: Settings, args: argparse.Namespace) -> int:
    async def work(session: AsyncSession) -> str:
        tenant = await TenantService(session, actor()).create(args.name, args.plan or None)
        return f"created tenant {tenant.name} ({tenant.id})"

    return print_in_session(settings, work)


def _tenants_list(settings: Settings, args: argparse.Namespace) -> int:
    async def work(session: AsyncSession) -> list[str]:
        return [f"{t.name}\t{t.id}" for t in await TenantService(session).list()]

    print("\n".join(["NAME\tID", *in_session(settings, work)]))
    return 0


def _keys_create(settings: Settings, args: argparse.Namespace) -> int:
    async def work(session: AsyncSession) -> str:
        tenant = await TenantService(session).get(args.tenant)
        role = KeyRole.ADMIN if args.admin else KeyRole.TENANT
        created = await ApiKeyService(session, actor()).create(tenant, args.name, role)
        return created.secret

    secret = in_session(settings, work)
    print(secret)
    print("store this key now: it is shown only once", file=sys.stderr)
    return 0


def _keys_list(settings: Settings, args: argparse.Namespace) -> int:
    async def work(session: AsyncSession) -> list[str]:
        tenant = await TenantService(session).get(args.tenant) if args.tenant else None
        rows = await ApiKeyService(session).list(tenant)
        return [
            "\t".join(
                [
                    key.prefix,
                    tenant_name,
                    key.role,
                    key.status,
                    key.name or "-",
                    key.created_at.isoformat(timespec="seconds"),
                    key.last_used_at.isoformat(timespec="seconds") if key.last_used_at else "never",
                    key.id,
                ]
            )
            for key, tenant_name in rows
        ]

    header = "PREFIX\tTENANT\tROLE\tSTATUS\tNAME\tCREATED\tLAST USED\tID"
    print("\n".join([header, *in_session(settings, work)]))
    return 0


def _keys_revoke(settings: Settings, args: argparse.Namespace) -> int:
    async def work(session: AsyncSession) -> str:
        key = await ApiKeyService(session, actor()).revoke(args.key)
        return f"revoked {key.prefix} ({key.id})"

    return print_in_session(settings, work)


def _admin_password(settings: Settings) -> str:
    if password := settings.admin_password:
        return password
    if not sys.stdin.isatty():
        return sys.stdin.readline().rstrip("\n")
    password = getpass.getpass("password: ")
    if getpass.getpass("again: ") != password:
        raise InvalidInputError("the passwords differ")
    return password


def _admins_create(settings: Settings, args: argparse.Namespace) -> int:
    password = _admin_password(settings)

    async def work(session: AsyncSession) -> str:
        admin = await AdminService(session, actor()).create(args.email, args.role, password)
        return f"created {admin.role} {admin.email}: sign in at /admin"

    return print_in_session(settings, work)


def _when(moment: datetime | None) -> str:
    return moment.isoformat(timespec="seconds") if moment else "never"


def _admins_list(settings: Settings, args: argparse.Namespace) -> int:
    async def work(session: AsyncSession) -> list[str]:
        admins = await AdminService(session).list()
        return [f"{a.email}\t{a.role}\t{_when(a.last_login_at)}" for a in admins]

    print("\n".join(["EMAIL\tROLE\tLAST SIGN-IN", *in_session(settings, work)]))
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    sys.exit(main())
