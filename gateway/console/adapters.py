"""The console's Adapters page: the tenants' LoRA adapters (tenants/adapters.py), all of
them or one tenant's (`?tenant=NAME`, linked from the tenant's page), and (owners) a
button to remove one. Adding takes a folder on the engines' hosts: the CLI and the admin
API do that. The same AdapterService, audited as the administrator."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Response, get, post
from litestar.di import NamedDependency

from gateway.console.context import ConsoleAction, ConsolePage
from tenants.adapters import AdapterService

HERE = "/admin/adapters"


class AdaptersController(Controller):
    path = "/adapters"

    @get("/")
    async def adapters(self, ctx: NamedDependency[ConsolePage]) -> Response[str]:
        tenant = ctx.query("tenant") or None
        return ctx.render(
            "adapters.html",
            title=f"Adapters of {tenant}" if tenant else "Adapters",
            tenant=tenant,
            adapters=await AdapterService(ctx.db).list(tenant),
        )

    @post("/remove")
    async def remove_adapter(self, action: NamedDependency[ConsoleAction]) -> Response[Any]:
        return await action.remove(HERE, AdapterService(action.db, action.actor).remove)
