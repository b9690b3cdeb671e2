"""/admin/api/adapters: the tenants' LoRA adapters (tenants/adapters.py), added, listed
and removed by administrators, each change audited as the calling admin. Every gateway
replica routes a change within a few seconds (the model directory's refresh)."""

from __future__ import annotations

from typing import Any

from litestar import Controller, delete, get, post
from litestar.di import NamedDependency, Provide
from litestar.params import FromPath, FromQuery, RawBody
from msgspec import Struct

from gateway.admin.controllers import admin_dependencies
from gateway.api.schemas import decode
from gateway.dispatch.directory import ModelDirectory
from gateway.openapi import ADMIN, ADMIN_WRITE, route
from gateway.openapi.shapes import LoRAAdapter
from gateway.settings import Settings
from tenants.adapters import AdapterService, adapter_view


class AdapterBody(Struct, kw_only=True, forbid_unknown_fields=True):
    """An adapter to add; the service checks the values and the folder."""

    name: str
    base_model: str
    path: str  # a PEFT folder on the engines' hosts
    tenant: str  # the owner's name


def max_lora_rank(settings: NamedDependency[Settings]) -> int:
    """The engine's largest adapter rank (the in-process engine's knob, which `tollgate
    backend serve` reads from the same variable)."""
    return settings.engine.max_lora_rank


class AdapterAdminController(Controller):
    path = "/admin/api/adapters"
    tags = ["Admin"]
    dependencies = {
        **admin_dependencies(adapters=AdapterService),
        "max_rank": Provide(max_lora_rank, sync_to_thread=False),
    }

    @route(get, "/", list[LoRAAdapter], errors=ADMIN)
    async def list_adapters(
        self, adapters: NamedDependency[AdapterService], tenant: FromQuery[str | None] = None
    ) -> list[dict[str, Any]]:
        """Every tenant's adapters, or `?tenant=NAME`'s alone."""
        return [adapter_view(row, owner) for row, owner in await adapters.list(tenant)]

    @route(post, "/", LoRAAdapter, body=AdapterBody, status=201, errors=ADMIN_WRITE)
    async def create_adapter(
        self,
        body: RawBody,
        adapters: NamedDependency[AdapterService],
        max_rank: NamedDependency[int],
        directory: NamedDependency[ModelDirectory],
    ) -> dict[str, Any]:
        given = decode(body, AdapterBody)
        served = directory.names()  # the default entry's name too, which no table holds
        row, owner = await adapters.add(
            given.name, given.base_model, given.path, given.tenant, max_rank, served
        )
        return adapter_view(row, owner.name)

    @route(delete, "/{name:path}", None, status=204, errors=ADMIN_WRITE)
    async def remove_adapter(
        self, name: FromPath[str], adapters: NamedDependency[AdapterService]
    ) -> None:
        await adapters.remove(name.lstrip("/"))
