"""The console's Batches page, per tenant: each batch's progress and counts, its results
to download, and (owners) a button to cancel it."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from litestar import Controller, Response, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath

from gateway.console.context import ConsoleAction, ConsolePage
from gateway.console.render import or_back_to
from tenants import audit
from tenants.batches import BatchStore
from tenants.blobs import BlobStore
from tenants.errors import NotFoundError
from tenants.files import FileStore
from tenants.services import TenantService

SHOWN = 100  # the latest batches a page lists


class BatchesController(Controller):
    path = "/tenants/{name:str}/batches"

    @get("/")
    async def batches(
        self, name: FromPath[str], ctx: NamedDependency[ConsolePage]
    ) -> Response[str]:
        tenant = await TenantService(ctx.db).get(name)
        batches = await BatchStore(ctx.db, tenant.id).list(limit=SHOWN)
        return ctx.render(
            "batches.html",
            title=f"Batches of {tenant.name}",
            tenant=tenant,
            batches=batches,
        )

    @get("/{batch_id:str}/{which:str}")
    async def download(
        self,
        name: FromPath[str],
        batch_id: FromPath[str],
        which: FromPath[str],
        ctx: NamedDependency[ConsolePage],
        file_blobs: NamedDependency[BlobStore],
    ) -> Response[bytes]:
        """The batch's output (`output`) or error (`errors`) file, as JSONL."""
        tenant = await TenantService(ctx.db).get(name)
        batch = await BatchStore(ctx.db, tenant.id).get(batch_id)
        file_id = {"output": batch.output_file_id, "errors": batch.error_file_id}.get(which)
        if file_id is None:
            raise NotFoundError(f"batch {batch_id} has no {which} file")
        content = await FileStore(ctx.db, file_blobs, tenant.id).content(file_id)
        disposition = f'attachment; filename="{batch_id}_{which}.jsonl"'
        return Response(
            content,
            media_type="application/jsonl",
            headers={"Content-Disposition": disposition},
        )

    @post("/{batch_id:str}/cancel")
    async def cancel(
        self, name: FromPath[str], batch_id: FromPath[str], action: NamedDependency[ConsoleAction]
    ) -> Response[Any]:
        here = f"/admin/tenants/{quote(name)}/batches"
        with or_back_to(here):
            tenant = await TenantService(action.db).get(name)
            await BatchStore(action.db, tenant.id).cancel(batch_id)
        await audit.record(  # in the cancel's transaction, as the services' changes are
            action.db,
            actor=action.actor.name,
            action="batch.cancel",
            target=f"batch:{batch_id}",
            tenant_id=tenant.id,
            context=action.actor.context,
        )
        await action.db.commit()
        action.request.app.state.batch_runner.wake(batch_id)
        return action.back(here, f"Cancelling {batch_id}: lines under way finish, the rest stop.")
