"""`tollgate`: serve the gateway and manage the database, tenants and keys."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TypeVar

from sqlalchemy.ext.asyncio import AsyncSession

from gateway.settings import Settings, SettingsError
from tenants import db
from tenants.errors import DomainError
from tenants.models import KeyRole
from tenants.services import ApiKeyService, TenantService

T = TypeVar("T")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        settings = Settings.from_env()
        result: int = args.handler(settings, args)
    except (SettingsError, DomainError) as exc:
        print(f"tollgate: {exc}", file=sys.stderr)
        return 2
    return result


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tollgate", description=__doc__)
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="run the gateway with the in-process engine")
    serve.add_argument("--host", help="interface to bind (TOLLGATE_HOST, default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (TOLLGATE_PORT, default 8000)")
    serve.add_argument("--model", type=Path, help="checkpoint folder (TOLLGATE_MODEL)")
    serve.set_defaults(handler=_serve)

    backend = commands.add_parser("backend", help="inference backend replicas")
    backend_commands = backend.add_subparsers(required=True)
    backend_serve = backend_commands.add_parser(
        "serve", help="run the engine behind the internal HTTP API (TOLLGATE_BACKEND_SECRET)"
    )
    backend_serve.add_argument("--model", type=Path, help="checkpoint folder (default: built-in)")
    backend_serve.add_argument("--host", default="127.0.0.1")
    backend_serve.add_argument("--port", type=int, default=9000)
    backend_serve.set_defaults(handler=_backend_serve)

    database = commands.add_parser("db", help="database schema").add_subparsers(required=True)
    upgrade = database.add_parser("upgrade", help="apply migrations")
    upgrade.add_argument("revision", nargs="?", default="head")
    upgrade.set_defaults(handler=_db_upgrade)
    downgrade = database.add_parser("downgrade", help="revert migrations")
    downgrade.add_argument("revision")
    downgrade.set_defaults(handler=_db_downgrade)
    database.add_parser("current", help="show the applied revision").set_defaults(
        handler=_db_current
    )

    tenants = commands.add_parser("tenants", help="tenants").add_subparsers(required=True)
    create_tenant = tenants.add_parser("create", help="create a tenant")
    create_tenant.add_argument("name")
    create_tenant.set_defaults(handler=_tenants_create)
    tenants.add_parser("list", help="list tenants").set_defaults(handler=_tenants_list)

    api_keys = commands.add_parser("keys", help="API keys").add_subparsers(required=True)
    create_key = api_keys.add_parser("create", help="create a key (printed once)")
    create_key.add_argument("--tenant", required=True)
    create_key.add_argument("--name", default="")
    create_key.add_argument("--admin", action="store_true", help="may also administer")
    create_key.set_defaults(handler=_keys_create)
    list_keys = api_keys.add_parser("list", help="list keys (prefixes only)")
    list_keys.add_argument("--tenant")
    list_keys.set_defaults(handler=_keys_list)
    revoke = api_keys.add_parser("revoke", help="revoke a key by id or prefix")
    revoke.add_argument("key")
    revoke.set_defaults(handler=_keys_revoke)
    return parser


def _in_session(settings: Settings, work: Callable[[AsyncSession], Awaitable[T]]) -> T:
    async def run() -> T:
        engine = db.create_engine(settings.database_url)
        try:
            async with db.session_factory(engine).begin() as session:
                return await work(session)
        finally:
            await engine.dispose()

    return asyncio.run(run())


def _serve(settings: Settings, args: argparse.Namespace) -> int:
    from gateway.serve import serve

    settings = settings.with_overrides(host=args.host, port=args.port, model_path=args.model)
    return serve(settings)


def _backend_serve(settings: Settings, args: argparse.Namespace) -> int:
    from gateway.serve import serve_backend

    model = args.model or settings.model_path
    return serve_backend(settings.with_overrides(host=args.host, port=args.port, model_path=model))


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


def _tenants_create(settings: Settings, args: argparse.Namespace) -> int:
    async def work(session: AsyncSession) -> str:
        tenant = await TenantService(session).create(args.name)
        return f"created tenant {tenant.name} ({tenant.id})"

    print(_in_session(settings, work))
    return 0


def _tenants_list(settings: Settings, args: argparse.Namespace) -> int:
    async def work(session: AsyncSession) -> list[str]:
        return [f"{t.name}\t{t.id}" for t in await TenantService(session).list()]

    print("\n".join(["NAME\tID", *_in_session(settings, work)]))
    return 0


def _keys_create(settings: Settings, args: argparse.Namespace) -> int:
    async def work(session: AsyncSession) -> str:
        tenant = await TenantService(session).get(args.tenant)
        role = KeyRole.ADMIN if args.admin else KeyRole.TENANT
        created = await ApiKeyService(session).create(tenant, args.name, role)
        return created.secret

    secret = _in_session(settings, work)
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
    print("\n".join([header, *_in_session(settings, work)]))
    return 0


def _keys_revoke(settings: Settings, args: argparse.Namespace) -> int:
    async def work(session: AsyncSession) -> str:
        key = await ApiKeyService(session).revoke(args.key)
        return f"revoked {key.prefix} ({key.id})"

    print(_in_session(settings, work))
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    sys.exit(main())
