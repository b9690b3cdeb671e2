"""One batch line through the same path as the request it stands for: admission (its
reservation at the batch price), the engine (at the batch class), settlement (one ledger
row). The line's Idempotency-Key bills it once: a line run again after a restart (billed,
its result not yet kept) is not billed again. It claims no stored answer nor in-flight lock
(gateway/api/openai.py's admit): the line keeps its result, and its lease runs it once at a
time."""

from __future__ import annotations

import asyncio
import json
from typing import Any, cast

import msgspec
from litestar import Request, Response

from gateway.admission.idempotency import HEADER
from gateway.api.embeddings import EmbeddingRequest, embed
from gateway.api.openai import chat, complete
from gateway.api.schemas import ChatCompletionRequest, CompletionRequest, decode
from gateway.api.services import GenerationServices
from gateway.batches.execute import RETRY_STATUSES, Retry
from gateway.core.errors import ApiError, InvalidRequest
from tenants.batches import LineOutcome
from tenants.models import BATCH_ENDPOINT_PREFIX
from tenants.services import Principal


class _LineRequest:
    """What the request path reads of an HTTP request, for a line: its body, its
    Idempotency-Key, and a client that never leaves."""

    def __init__(self, body: bytes, key: str) -> None:
        self._body = body
        self.headers = {HEADER: key}

    async def body(self) -> bytes:
        return self._body

    async def receive(self) -> dict[str, Any]:
        await asyncio.Event().wait()  # never: a batch has no connection to lose
        raise AssertionError("unreachable")


async def run_line(
    services: GenerationServices,
    principal: Principal,
    endpoint: str,
    body: dict[str, Any],
    key: str,
    priority: int,
) -> LineOutcome:
    raw = msgspec.json.encode(body)
    request = cast(Request[Any, Any, Any], _LineRequest(raw, key))
    try:
        response = await _dispatch(request, services, principal, endpoint, raw, priority)
    except ApiError as exc:
        if exc.status in RETRY_STATUSES and exc.retryable:
            raise Retry from exc
        return LineOutcome(exc.status, exc.body(), None)
    content = response.content
    result = json.loads(content) if isinstance(content, bytes) else content
    status = response.status_code or 200  # a whole answer names no status: 200
    return LineOutcome(status, result, response.headers.get("x-request-id"))


async def _dispatch(
    request: Request[Any, Any, Any],
    services: GenerationServices,
    principal: Principal,
    endpoint: str,
    raw: bytes,
    priority: int,
) -> Response[Any]:
    name = BATCH_ENDPOINT_PREFIX + endpoint.removeprefix("/v1/").replace("/", ".")
    if endpoint == "/v1/chat/completions":
        chat_body = decode(raw, ChatCompletionRequest)
        _refuse_stream(chat_body.stream)
        chat_body.priority = priority
        return await chat(request, services, principal, chat_body, endpoint=name)
    if endpoint == "/v1/completions":
        text_body = decode(raw, CompletionRequest)
        _refuse_stream(text_body.stream)
        text_body.priority = priority
        return await complete(request, services, principal, text_body, endpoint=name)
    embedding_body = decode(raw, EmbeddingRequest)
    return await embed(request, services, principal, embedding_body, name, priority)


def _refuse_stream(stream: bool) -> None:
    if stream:
        raise InvalidRequest("a batch line cannot stream", param="stream")
