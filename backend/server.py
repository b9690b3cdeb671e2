"""The engine behind an internal HTTP API, for remote mode (`tollgate backend serve`).

Every route but /healthz and /readyz needs the shared secret in `x-tollgate-secret`. Generation
streams newline-delimited JSON, one typed line per output (backend/wire.py: the protocol);
a client that disconnects aborts its request, so the engine never works for nobody.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
from litestar import Litestar, MediaType, Request, Response, Router, get, post
from litestar.connection import ASGIConnection
from litestar.exceptions import NotAuthorizedException
from litestar.handlers.base import BaseRouteHandler
from litestar.response import Stream
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from backend.outputs import RequestOutput
from backend.telemetry import (
    EngineRequestMetrics,
    EngineStatsCollector,
    ModelServerCollector,
    served,
)
from backend.wire import (
    REFUSALS,
    SECRET_HEADER,
    AbortBody,
    EmbedBody,
    EmbedReply,
    ErrorKind,
    ErrorLine,
    GenerateBody,
    OutputLine,
    invalid_body,
    stats_reply,
)

if TYPE_CHECKING:
    from backend.engine.async_engine import AsyncEngine

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def _engine(request: Request[Any, Any, Any]) -> AsyncEngine:
    engine: AsyncEngine = request.app.state.engine
    return engine


_bodies = msgspec.json.Decoder(GenerateBody)
_embeds = msgspec.json.Decoder(EmbedBody)
_aborts = msgspec.json.Decoder(AbortBody)


@post("/internal/generate", status_code=200)
async def generate(request: Request[Any, Any, Any]) -> Response[Any]:
    try:
        body = _bodies.decode(await request.body())
    except (msgspec.DecodeError, ValueError, RecursionError) as exc:  # RecursionError: too deep
        return Response(invalid_body(exc), status_code=400)
    engine = _engine(request)
    if not engine.is_running():
        return Response(ErrorLine("engine_dead", "engine is not running"), status_code=503)
    outputs = engine.generate(body.received())
    metrics = request.app.state.engine_metrics
    outputs = served(outputs, request.headers, body.request_id, body.priority, metrics)
    return Stream(_ndjson(outputs), media_type="application/x-ndjson")


async def _ndjson(outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[bytes]:
    """One line per output; a refusal ends the stream with its typed line: the scheduling
    policy's (overloaded, deadline_exceeded), the caller's input (invalid_request, before
    the request started), a step that failed this request (request_failed: the engine
    goes on, and the gateway must not retry it where it could fail the same way)."""
    encoder = msgspec.json.Encoder()
    try:
        async for out in outputs:
            yield encoder.encode(OutputLine(out)) + b"\n"
    except REFUSALS as exc:
        yield encoder.encode(ErrorLine.of(exc)) + b"\n"
    except ValueError:
        # A defect of ours, not the caller's input: the gateway answers 500 and keeps
        # this replica in routing (a broken stream would take it out).
        log.exception("a request failed in the engine")
        line = ErrorLine("request_failed", "the engine failed this request")
        yield encoder.encode(line) + b"\n"


@post("/internal/embed", status_code=200)
async def embed(request: Request[Any, Any, Any]) -> Response[EmbedReply | ErrorLine]:
    """Mean-pooled final hidden states, one vector per prompt; a refusal is an ErrorLine
    with the status the gateway maps (400 invalid, 503 overloaded or dead, 500 failed)."""
    try:
        body = _embeds.decode(await request.body())
    except (msgspec.DecodeError, RecursionError) as exc:
        return Response(invalid_body(exc), status_code=400)
    try:
        vectors = await _engine(request).embed(body.prompts)
    except REFUSALS as exc:
        line = ErrorLine.of(exc)
        return Response(line, status_code=EMBED_STATUS[line.kind])
    return Response(EmbedReply(vectors))


EMBED_STATUS: dict[ErrorKind, int] = {
    "invalid_request": 400,
    "overloaded": 503,
    "engine_dead": 503,
    "deadline_exceeded": 500,
    "request_failed": 500,
}


@post("/internal/abort", status_code=200)
async def abort(request: Request[Any, Any, Any]) -> Response[dict[str, bool] | ErrorLine]:
    try:
        body = _aborts.decode(await request.body())
    except (msgspec.DecodeError, RecursionError) as exc:  # ValidationError is a DecodeError
        return Response(invalid_body(exc), status_code=400)
    _engine(request).abort(body.request_id)
    return Response({"ok": True})


@get("/internal/info", media_type=MediaType.JSON)
async def info(request: Request[Any, Any, Any]) -> dict[str, Any]:
    """What a gateway needs to tokenize locally: the model's name, context and tokenizer."""
    engine = _engine(request)
    model_dir: Path = request.app.state.model_dir
    files = {
        name: (model_dir / name).read_text(encoding="utf-8")
        for name in TOKENIZER_FILES
        if (model_dir / name).is_file()
    }
    return {
        "model": engine.model_name,
        "max_model_len": engine.max_model_len,
        "hidden_size": engine.engine.model_config.hidden_size,
        "files": files,
    }


@get("/internal/kv", media_type=MediaType.JSON)
async def kv(request: Request[Any, Any, Any]) -> dict[str, Any]:
    """The model's shapes and the KV pool, for capacity planning (`tollgate capacity
    check --url`, the console's Capacity page)."""
    engine = _engine(request)
    inner = engine.engine
    runner = inner.runner
    cache = runner.kv_cache
    return {
        "model": engine.model_name,
        "max_model_len": engine.max_model_len,
        "config": msgspec.to_builtins(inner.model_config),
        "device": str(runner.device),
        "dtype": str(runner.dtype).removeprefix("torch."),
        "kv_dtype": str(runner.kv_dtype).removeprefix("torch."),
        "block_size": inner.config.block_size,
        "num_blocks": runner.num_blocks,
        "tensor_bytes": cache.numel() * cache.element_size(),
        "kv_cache_bytes": inner.config.kv_cache_bytes,
        "num_kv_blocks": inner.config.num_kv_blocks,
        "max_num_batched_tokens": inner.config.max_num_batched_tokens,
    }


@get("/internal/stats", media_type=MediaType.JSON)
async def stats(request: Request[Any, Any, Any]) -> dict[str, object]:
    """Load for routing; `running` is false while draining, so gateways route elsewhere."""
    engine = _engine(request)
    return stats_reply(engine.is_running() and not _draining(request), engine.stats())


@get("/metrics")
async def metrics(request: Request[Any, Any, Any]) -> Response[bytes]:
    """Engine stats in the Prometheus text format, under Tollgate's names and vLLM's
    (see backend/telemetry.py)."""
    registry: CollectorRegistry = request.app.state.metrics
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


@get("/healthz", media_type=MediaType.JSON)
async def healthz(request: Request[Any, Any, Any]) -> Response[dict[str, str]]:
    """Liveness: the engine loop runs (a draining replica is still alive)."""
    running = _engine(request).is_running()
    return Response({"status": "ok" if running else "dead"}, status_code=200 if running else 503)


@get("/readyz", media_type=MediaType.JSON)
async def readyz(request: Request[Any, Any, Any]) -> Response[dict[str, str]]:
    """Readiness: takes new requests (running, and not draining)."""
    if not _engine(request).is_running():
        return Response({"status": "dead"}, status_code=503)
    if _draining(request):
        return Response({"status": "draining"}, status_code=503)
    return Response({"status": "ready"}, status_code=200)


def _draining(request: Request[Any, Any, Any]) -> bool:
    """Set by `tollgate backend serve` (gateway/cli/drain.py) on SIGTERM."""
    drain = request.app.state.get("drain")
    return drain is not None and bool(drain.draining)


def create_backend_app(engine: AsyncEngine, model_dir: Path, secret: str) -> Litestar:
    if not secret:
        raise ValueError("the backend needs a shared secret (TOLLGATE_BACKEND_SECRET)")

    def require_secret(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
        # The header for gateways; a bearer token for Prometheus scrapers.
        given = connection.headers.get(SECRET_HEADER) or connection.headers.get(
            "authorization", ""
        ).removeprefix("Bearer ")
        if not hmac.compare_digest(given.encode(), secret.encode()):
            raise NotAuthorizedException("missing or wrong backend secret")

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        app.state.engine = engine
        app.state.model_dir = model_dir
        app.state.metrics = CollectorRegistry()
        app.state.metrics.register(EngineStatsCollector(engine.stats))
        app.state.metrics.register(ModelServerCollector(engine.stats, engine.model_name))
        app.state.engine_metrics = EngineRequestMetrics(app.state.metrics)
        try:
            yield
        finally:
            await engine.shutdown()

    return Litestar(
        route_handlers=[
            Router(
                "/",
                route_handlers=[generate, embed, abort, info, kv, stats, metrics],
                guards=[require_secret],
            ),
            healthz,
            readyz,
        ],
        lifespan=[lifespan],
        openapi_config=None,
        logging_config=None,  # logging (JSON lines) is set up by `tollgate backend serve`
    )
