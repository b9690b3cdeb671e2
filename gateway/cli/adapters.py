"""`tollgate adapters …`: the tenants' LoRA adapters (add, list, remove), audited as the
CLI user. The folder is checked against the engine's knobs as this environment sets them
(TOLLGATE_MAX_LORA_RANK); every gateway replica routes a change within a few seconds."""

from __future__ import annotations

import argparse
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from gateway.cli.support import actor, command, group, in_session, print_views, remove_served
from gateway.settings import Settings
from tenants.adapters import AdapterService, adapter_view


def add_commands(commands: Any) -> None:
    adapters = group(commands, "adapters", "tenants' LoRA adapters")
    add = command(adapters, "add", "give a tenant a LoRA adapter (a PEFT folder)", _add)
    add.add_argument("name", help="what the tenant names in `model`")
    add.add_argument("--base", required=True, help="the served model it adapts")
    add.add_argument(
        "--path", required=True, help="absolute PEFT folder (adapter_config.json + weights)"
    )
    add.add_argument("--tenant", required=True, help="the tenant that owns it")
    listing = command(adapters, "list", "adapters, every tenant's or one's", _list)
    listing.add_argument("--tenant", help="only this tenant's")
    listing.add_argument("--json", action="store_true", help="as JSON")
    command(adapters, "remove", "remove an adapter", _remove).add_argument("name")


def _add(settings: Settings, args: argparse.Namespace) -> int:
    max_rank = settings.engine.max_lora_rank

    async def work(session: AsyncSession) -> dict[str, Any]:
        service = AdapterService(session, actor())
        row, owner = await service.add(args.name, args.base, args.path, args.tenant, max_rank)
        return adapter_view(row, owner.name)

    print(f"added {_row(in_session(settings, work))}")
    return 0


def _list(settings: Settings, args: argparse.Namespace) -> int:
    async def work(session: AsyncSession) -> list[dict[str, Any]]:
        rows = await AdapterService(session).list(args.tenant)
        return [adapter_view(row, owner) for row, owner in rows]

    header = "NAME\tTENANT\tBASE\tRANK\tTARGETS\tPATH"
    return print_views(in_session(settings, work), header, _row, args.json)


def _remove(settings: Settings, args: argparse.Namespace) -> int:
    return remove_served(settings, AdapterService, args.name)


def _row(view: dict[str, Any]) -> str:
    targets = ",".join(view["target_modules"])
    return (
        f"{view['name']}\t{view['tenant']}\t{view['base_model']}\t{view['rank']}\t"
        f"{targets}\t{view['path']}"
    )
