"""The engine behind an internal HTTP API, for remote mode (`tollgate backend serve`).

Every route but /healthz and /readyz needs the shared secret in `x-tollgate-secret`. Generation
streams newline-delimited JSON, one RequestOutput per line; a client that disconnects
aborts its request, so the engine never works for nobody.
"""

from __future__ import annotations

import hmac
import logging
import time
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

from backend.errors import (
    DeadlineExceededError,
    EngineDeadError,
    InvalidParameterError,
    OverloadedError,
    RequestFailedError,
)
from backend.sampling import SamplingParams
from backend.telemetry import (
    EngineRequestMetrics,
    EngineStatsCollector,
    ModelServerCollector,
    served,
)

if TYPE_CHECKING:
    from backend.engine.async_engine import AsyncEngine

log = logging.getLogger(__name__)

SECRET_HEADER = "x-tollgate-secret"  # noqa: S105 (a header name, not a secret)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


class GenerateBody(msgspec.Struct):
    request_id: str
    prompt: list[int]
    params: SamplingParams
    priority: int = 0
    tenant: str | None = None
    weight: int = 1  # the tenant's share of the token budget under contention
    timeout_s: float | None = None  # first-token deadline, relative: clocks differ by host


class EmbedBody(msgspec.Struct):
    prompts: list[list[int]]


class AbortBody(msgspec.Struct):
    request_id: str


def _engine(request: Request[Any, Any, Any]) -> AsyncEngine:
    engine: AsyncEngine = request.app.state.engine
    return engine


@post("/internal/generate", status_code=200)
async def generate(request: Request[Any, Any, Any]) -> Response[Any]:
    try:
        body = msgspec.json.decode(await request.body(), type=GenerateBody)
    except (msgspec.DecodeError, ValueError, RecursionError) as exc:  # RecursionError: too deep
        return Response(_refusal(exc), status_code=400)
    engine = _engine(request)
    if not engine.is_running():
        return Response({"error": "engine is not running"}, status_code=503)
    deadline = None if body.timeout_s is None else time.monotonic() + body.timeout_s
    outputs = engine.generate(
        body.prompt,
        body.params,
        request_id=body.request_id,
        priority=body.priority,
        deadline=deadline,
        tenant=body.tenant,
        weight=body.weight,
    )
    metrics = request.app.state.engine_metrics
    outputs = served(outputs, request.headers, body.request_id, body.priority, metrics)
    return Stream(_ndjson(outputs), media_type="application/x-ndjson")


async def _ndjson(outputs: AsyncIterator[Any]) -> AsyncIterator[bytes]:
    encoder = msgspec.json.Encoder()
    try:
        async for out in outputs:
            yield encoder.encode(out) + b"\n"
    except (OverloadedError, DeadlineExceededError) as exc:
        # Rejected by the scheduling policy: a typed line the gateway maps to 503 / 504.
        retry_after = exc.retry_after_s if isinstance(exc, OverloadedError) else None
        line = {"error": str(exc), "kind": exc.kind, "retry_after_s": retry_after}
        yield encoder.encode(line) + b"\n"
    except RequestFailedError as exc:
        # A step failed this request (the engine goes on): the gateway must not retry it
        # on another replica, where it could fail the same way.
        yield encoder.encode({"error": str(exc), "kind": exc.kind}) + b"\n"
    except InvalidParameterError as exc:  # the request never started: the caller's input
        yield encoder.encode({**_refusal(exc), "kind": "invalid_request"}) + b"\n"
    except EngineDeadError as exc:
        yield encoder.encode({"error": str(exc), "kind": "engine_dead"}) + b"\n"
    except ValueError:
        # A defect of ours, not the caller's input: the gateway answers 500 and keeps
        # this replica in routing (a broken stream would take it out).
        log.exception("a request failed in the engine")
        line = {"error": "the engine failed this request", "kind": RequestFailedError.kind}
        yield encoder.encode(line) + b"\n"


def _refusal(exc: Exception) -> dict[str, Any]:
    """A refused request on the wire: the message and the parameter at fault, if named
    (msgspec wraps a SamplingParams refusal in its ValidationError; the cause keeps it)."""
    cause = exc if isinstance(exc, InvalidParameterError) else exc.__cause__
    param = cause.param if isinstance(cause, InvalidParameterError) else None
    return {"error": str(exc), "param": param}


@post("/internal/embed", status_code=200)
async def embed(request: Request[Any, Any, Any]) -> Response[Any]:
    """Mean-pooled final hidden states, one vector per prompt: `{"embeddings": [...]}`;
    a refusal is a typed error (`kind`) with the status the gateway maps."""
    try:
        body = msgspec.json.decode(await request.body(), type=EmbedBody)
    except (msgspec.DecodeError, RecursionError) as exc:
        return Response(_refusal(exc), status_code=400)
    try:
        vectors = await _engine(request).embed(body.prompts)
    except InvalidParameterError as exc:
        return Response(_refusal(exc), status_code=400)
    except OverloadedError as exc:
        line = {"error": str(exc), "kind": exc.kind, "retry_after_s": exc.retry_after_s}
        return Response(line, status_code=503)
    except EngineDeadError as exc:
        return Response({"error": str(exc), "kind": "engine_dead"}, status_code=503)
    except RequestFailedError as exc:
        return Response({"error": str(exc), "kind": exc.kind}, status_code=500)
    return Response({"embeddings": vectors})


@post("/internal/abort", status_code=200)
async def abort(request: Request[Any, Any, Any]) -> Response[dict[str, Any]]:
    try:
        body = msgspec.json.decode(await request.body(), type=AbortBody)
    except (msgspec.DecodeError, RecursionError) as exc:  # ValidationError is a DecodeError
        return Response({"error": str(exc)}, status_code=400)
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
        "block_size": inner.config.block_size,
        "num_blocks": runner.num_blocks,
        "tensor_bytes": cache.numel() * cache.element_size(),
        "kv_cache_bytes": inner.config.kv_cache_bytes,
        "num_kv_blocks": inner.config.num_kv_blocks,
        "max_num_batched_tokens": inner.config.max_num_batched_tokens,
    }


@get("/internal/stats", media_type=MediaType.JSON)
async def stats(request: Request[Any, Any, Any]) -> dict[str, Any]:
    """Load for routing; `running` is false while draining, so gateways route elsewhere."""
    engine = _engine(request)
    stats: dict[str, Any] = msgspec.to_builtins(engine.stats())
    return {"running": engine.is_running() and not _draining(request), **stats}


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
    """Set by `tollgate backend serve` (gateway/drain.py) on SIGTERM."""
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
