"""/v1/files and /v1/batches: OpenAI's Files and Batch APIs (the routes; the work is in
gateway.batches, the state in tenants.files and tenants.batches)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from litestar import Controller, Request, Response, delete, get, post
from litestar.datastructures import State, UploadFile
from litestar.di import NamedDependency, Provide
from litestar.params import FromPath, FromQuery
from msgspec import Meta, Struct
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.api.schemas import decode
from gateway.batches.service import BatchService
from gateway.batches.tasks import BatchWaker
from gateway.core.errors import InvalidRequest
from gateway.dispatch.directory import ModelDirectory
from gateway.http.auth import authenticate
from gateway.openapi import AUTHENTICATED, documented, route
from gateway.settings import Settings
from tenants.billing.prices import PriceBook
from tenants.blobs import BlobStore
from tenants.files import MAX_FILE_BYTES
from tenants.quota import QuotaStore
from tenants.services import Principal

FILE_ERRORS = (*AUTHENTICATED, 404)
CREATE_ERRORS = (*FILE_ERRORS, 402, 409, 413, 429)
MAX_LIST = 100  # batches a page of the list holds at most


class FileObject(Struct):
    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: str
    status_details: str | None


class FileList(Struct):
    object: Literal["list"]
    data: list[FileObject]
    has_more: bool


class DeletedFile(Struct):
    id: str
    object: Literal["file"]
    deleted: bool


class RequestCounts(Struct):
    total: int
    completed: int
    failed: int


class BatchObject(Struct):
    id: str
    object: Literal["batch"]
    endpoint: str
    errors: dict[str, Any] | None
    input_file_id: str
    completion_window: str
    status: str
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    metadata: dict[str, str] | None


class BatchList(Struct):
    object: Literal["list"]
    data: list[BatchObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


# OpenAI's bounds on metadata: up to 16 pairs, keys of 64 characters, values of 512.
MetadataKey = Annotated[str, Meta(max_length=64)]
MetadataValue = Annotated[str, Meta(max_length=512)]
Metadata = Annotated[dict[MetadataKey, MetadataValue], Meta(max_length=16)]


class CreateBatch(Struct, kw_only=True):
    input_file_id: Annotated[str, Meta(min_length=1, max_length=64)]
    endpoint: str
    completion_window: str
    metadata: Metadata | None = None


def provide_batch_runner(state: State) -> BatchWaker:
    runner: BatchWaker = state.batch_runner
    return runner


def provide_batch_service(
    db_session: NamedDependency[AsyncSession],
    principal: NamedDependency[Principal],
    file_blobs: NamedDependency[BlobStore],
    directory: NamedDependency[ModelDirectory],
    prices: NamedDependency[PriceBook],
    quota_store: NamedDependency[QuotaStore],
    settings: NamedDependency[Settings],
) -> BatchService:
    file_quota = settings.files_max_bytes_per_tenant
    return BatchService(
        db_session, principal, file_blobs, directory, prices, quota_store, file_quota
    )


_DEPENDENCIES = {
    "principal": Provide(authenticate),
    "service": Provide(provide_batch_service, sync_to_thread=False),
}


FORM_BYTES = 2**16  # the form's fields and boundaries around the file, at most


class FilesController(Controller):
    path = "/v1/files"
    tags = ["Files"]
    dependencies = _DEPENDENCIES

    @post(  # not route(): it sets its own body limit too
        "/",
        status_code=200,
        request_max_body_size=MAX_FILE_BYTES + FORM_BYTES,
        operation_class=documented(FileObject, errors=(*FILE_ERRORS, 413)),
    )
    async def upload(
        self, request: Request[Any, Any, Any], service: NamedDependency[BatchService]
    ) -> dict[str, Any]:
        """Upload a JSONL file of requests (multipart form: `file`, `purpose=batch`)."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > FORM_BYTES:  # the file is at least the rest
            await service.refuse_past_room(int(declared) - FORM_BYTES)
        form = await request.form()
        upload, purpose = form.get("file"), form.get("purpose")
        if not isinstance(upload, UploadFile):
            raise InvalidRequest("the form has no file", param="file")
        if not isinstance(purpose, str):
            raise InvalidRequest("the form has no purpose", param="purpose")
        stored = await service.upload(upload.filename or "", purpose, await upload.read())
        return stored.as_openai()

    @route(get, "/", FileList, errors=AUTHENTICATED)
    async def list_files(
        self, service: NamedDependency[BatchService], purpose: FromQuery[str | None] = None
    ) -> dict[str, Any]:
        files = await service.files.list(purpose)
        return {"object": "list", "data": [f.as_openai() for f in files], "has_more": False}

    @route(get, "/{file_id:str}", FileObject, errors=FILE_ERRORS)
    async def retrieve(
        self, file_id: FromPath[str], service: NamedDependency[BatchService]
    ) -> dict[str, Any]:
        return (await service.files.get(file_id)).as_openai()

    @route(get, "/{file_id:str}/content", str, errors=FILE_ERRORS, media_type="application/jsonl")
    async def content(
        self, file_id: FromPath[str], service: NamedDependency[BatchService]
    ) -> Response[bytes]:
        body = await service.files.content(file_id)
        return Response(body, media_type="application/jsonl")

    @route(delete, "/{file_id:str}", DeletedFile, errors=FILE_ERRORS)
    async def delete_file(
        self, file_id: FromPath[str], service: NamedDependency[BatchService]
    ) -> dict[str, Any]:
        stored = await service.files.delete(file_id)
        return {"id": stored.id, "object": "file", "deleted": True}


class BatchesController(Controller):
    path = "/v1/batches"
    tags = ["Batches"]
    dependencies = {
        **_DEPENDENCIES,
        "runner": Provide(provide_batch_runner, sync_to_thread=False),
    }

    @route(post, "/", BatchObject, body=CreateBatch, errors=CREATE_ERRORS)
    async def create(
        self,
        request: Request[Any, Any, Any],
        service: NamedDependency[BatchService],
        runner: NamedDependency[BatchWaker],
        db_session: NamedDependency[AsyncSession],
    ) -> dict[str, Any]:
        body = decode(await request.body(), CreateBatch)
        batch = await service.create(
            body.input_file_id, body.endpoint, body.completion_window, body.metadata
        )
        answer = batch.as_openai()
        await db_session.commit()  # the runner sees it once committed
        runner.wake(batch.id)
        return answer

    @route(get, "/", BatchList, errors=FILE_ERRORS)  # 404: `after`
    async def list_batches(
        self,
        service: NamedDependency[BatchService],
        after: FromQuery[str | None] = None,
        limit: FromQuery[int] = 20,
    ) -> dict[str, Any]:
        if not 1 <= limit <= MAX_LIST:
            raise InvalidRequest(f"limit must be between 1 and {MAX_LIST}", param="limit")
        batches = await service.batches.list(after, limit + 1)
        data = [b.as_openai() for b in batches[:limit]]
        return {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": len(batches) > limit,
        }

    @route(get, "/{batch_id:str}", BatchObject, errors=FILE_ERRORS)
    async def retrieve(
        self, batch_id: FromPath[str], service: NamedDependency[BatchService]
    ) -> dict[str, Any]:
        return (await service.batches.get(batch_id)).as_openai()

    @route(post, "/{batch_id:str}/cancel", BatchObject, errors=(*FILE_ERRORS, 409))
    async def cancel(
        self,
        batch_id: FromPath[str],
        service: NamedDependency[BatchService],
        runner: NamedDependency[BatchWaker],
        db_session: NamedDependency[AsyncSession],
    ) -> dict[str, Any]:
        batch = await service.batches.cancel(batch_id)
        answer = batch.as_openai()
        await db_session.commit()
        runner.wake(batch.id)
        return answer
