"""The Litestar app factory. Nothing happens at import time; settings are read here."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from datetime import timedelta
from functools import partial
from typing import Protocol, TypeVar

from litestar import Litestar
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.orm import Session

from backend import EngineConfig
from backend.builtin import BUILTIN_MODEL_DIR
from gateway.admin.adapters import AdapterAdminController
from gateway.admin.audit import AuditController
from gateway.admin.billing import BillingAdminController, UsageController
from gateway.admin.controllers import AdminController
from gateway.admission.auth_failures import AuthFailureLog
from gateway.admission.idempotency import Idempotency
from gateway.admission.key_generation import GenerationListener, SqliteGeneration
from gateway.admission.quota import Admission
from gateway.admission.reconcile import Rebuilder, Upkeep
from gateway.api.batch_lines import run_line
from gateway.api.batches import BatchesController, FilesController
from gateway.api.embeddings import EmbeddingsController
from gateway.api.health import healthz, readyz
from gateway.api.openai import OpenAIController
from gateway.api.responses import ResponsesController
from gateway.batches.runner import BatchRunner
from gateway.batches.service import open_blob_store
from gateway.batches.tasks import CeleryBatches, runs_in_celery
from gateway.billing.jobs import BillingJobs
from gateway.console import console_router
from gateway.core.tasks import Periodic, TaskSet
from gateway.dispatch import discovery
from gateway.dispatch.builder import client_builder
from gateway.dispatch.directory import ModelDirectory
from gateway.dispatch.engine_client import EngineClient, InProcessEngineClient
from gateway.http.auth import echo_request_id
from gateway.http.cors import Cors
from gateway.http.errors import exception_handlers
from gateway.http.metrics import metrics
from gateway.http.telemetry import observed
from gateway.metering.recorder import UsageRecorder
from gateway.openapi import openapi_config
from gateway.runtime import Runtime, dependencies
from gateway.settings import Settings
from gateway.telemetry import Telemetry
from tenants.billing.prices import PriceBook
from tenants.db import (
    create_direct_engine,
    create_engine,
    is_postgres,
    libpq_url,
    session_factory,
    sqlite_path,
)
from tenants.idempotency import InFlightLocks, MemoryLocks, RedisLocks
from tenants.pricing import DEFAULT_PRICE
from tenants.quota import open_quota_store
from tenants.quota.redis import connect as connect_redis

log = logging.getLogger(__name__)


def engine_config(settings: Settings) -> EngineConfig:
    """The in-process engine's knobs (TOLLGATE_<FIELD> variables, `tollgate serve` flags)."""
    return settings.engine


async def connect_engine(settings: Settings) -> EngineClient:
    """Remote replicas when TOLLGATE_BACKENDS is set; otherwise the engine in this process."""
    if settings.backends:
        assert settings.backend_secret is not None  # Settings checks this pairing
        return await discovery.connect(  # dns:// entries are re-resolved (discovery.py)
            settings.backends, settings.backend_secret, settings.data_dir
        )
    return await InProcessEngineClient.load(
        settings.model_path or BUILTIN_MODEL_DIR, engine_config(settings)
    )


def create_app(
    settings: Settings | None = None,
    engine_client: EngineClient | None = None,
) -> Litestar:
    """Build the gateway. Pass `engine_client` to share one engine (tests); otherwise the
    in-process engine loads `settings.model_path` (or the built-in model) at startup."""
    settings = settings or Settings.from_env()
    telemetry = Telemetry.from_settings(settings)  # /metrics access, tenant label bound

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        # Every resource is pushed on the stack as soon as it is open: shutdown, or a
        # failure halfway through startup, closes what was opened, in reverse order.
        async with AsyncExitStack() as stack:
            runtime = open_runtime(settings, telemetry, stack)
            app.state.runtime = runtime
            app.state.telemetry = telemetry
            await attach_engine(runtime, telemetry, stack, engine_client)
            await attach_models(runtime, telemetry, stack)
            # Closed first: what requests left behind (ledger writes, lock releases)
            # finishes while everything it needs is still open.
            stack.push_async_callback(runtime.tasks.drain)
            app.state.batch_runner = _started(stack, batch_runner(runtime))  # stops first
            yield

    app = Litestar(
        route_handlers=[
            OpenAIController,
            ResponsesController,
            EmbeddingsController,
            FilesController,
            BatchesController,
            AdminController,
            AdapterAdminController,
            UsageController,
            BillingAdminController,
            AuditController,
            console_router(),
            healthz,
            readyz,
            metrics,
        ],
        dependencies=dependencies(),
        exception_handlers=exception_handlers(),
        lifespan=[lifespan],
        before_send=[echo_request_id],
        openapi_config=openapi_config(),
        request_max_body_size=settings.max_body_bytes,
        logging_config=None,  # the process's logging (JSON lines) is set by `tollgate serve`
        debug=False,
    )
    # Around the router, not per route: a request no route takes (a 404) is observed too.
    app.asgi_handler = observed(telemetry, app.asgi_handler)
    if settings.cors_origins:  # outermost: a preflight is answered, not counted as a request
        app.asgi_handler = Cors(settings.cors_origins).middleware(app.asgi_handler)
    return app


class _Service(Protocol):
    def start(self) -> None: ...
    async def close(self) -> None: ...


S = TypeVar("S", bound=_Service)


def _started(stack: AsyncExitStack, service: S) -> S:
    """Start `service` with its close already on the stack: a start that fails halfway
    is closed too."""
    stack.push_async_callback(service.close)
    service.start()
    return service


def batch_runner(runtime: Runtime) -> BatchRunner | CeleryBatches:
    """Who runs batches: this gateway (embedded), or Celery workers (stack mode)."""
    if runs_in_celery(runtime.settings):
        return CeleryBatches(runtime.settings)
    return embedded_runner(runtime)


def embedded_runner(runtime: Runtime, only: str | None = None) -> BatchRunner:
    """The batch runner, running each line through the generation routes' own path: all
    the batches (a gateway's), or `only` one (a Celery task's, gateway/batches/worker.py)."""
    lines = partial(run_line, runtime.generation_services())
    services = (runtime.settings, lines, runtime.engine_client, runtime.file_blobs)
    return BatchRunner(runtime.sessions, *services, only=only)


async def open_worker_runtime(settings: Settings, stack: AsyncExitStack) -> Runtime:
    """A gateway's runtime without its HTTP side, for a Celery worker's batch tasks."""
    telemetry = Telemetry.from_settings(settings)
    runtime = open_runtime(settings, telemetry, stack)
    await attach_engine(runtime, telemetry, stack, None)
    await attach_models(runtime, telemetry, stack)
    stack.push_async_callback(runtime.tasks.drain)
    return runtime


def open_runtime(settings: Settings, telemetry: Telemetry, stack: AsyncExitStack) -> Runtime:
    """The database, the stores and the background jobs, each closed by `stack`."""
    db = create_engine(settings.database_url)
    stack.push_async_callback(db.dispose)
    direct = create_direct_engine(settings.database_url)
    stack.push_async_callback(direct.dispose)
    postgres = is_postgres(settings.database_url)
    session_class = type("RuntimeSession", (Session,), {})  # this runtime's sessions alone
    sessions = session_factory(db, session_class)
    generations = GenerationListener(libpq_url(settings.database_url)) if postgres else None
    if generations is not None:
        generations.learns_commits_of(session_class)
        _started(stack, generations)
    sqlite_file = sqlite_path(settings.database_url)
    sqlite_generation = SqliteGeneration(sqlite_file) if sqlite_file is not None else None
    if sqlite_generation is not None:
        _started(stack, sqlite_generation)
    redis = connect_redis(settings.redis_url) if settings.redis_url else None
    if redis is not None:
        stack.push_async_callback(redis.aclose)
    locks: InFlightLocks = RedisLocks(redis) if redis is not None else MemoryLocks()
    admission = open_admission(settings, sessions, stack)
    billing = BillingJobs(settings, sessions)
    _started(stack, billing.periodic() if BillingJobs.wanted(settings) else Periodic([]))
    _started(stack, billing.health(telemetry.metrics.registry))
    auth_failures = _started(stack, AuthFailureLog(sessions))
    tasks = TaskSet()
    recorder = UsageRecorder(
        sessions,
        PriceBook(sessions),
        tasks,
        admission,
        settings.checkpoint_ms / 1000,
        direct=direct if postgres else None,
        sqlite_file=sqlite_file,
        key_retention=timedelta(seconds=settings.idempotency_retention_s),
    )
    _started(stack, recorder)  # checkpoints of running streams
    _started(stack, recorder.periodic())  # the orphan sweep
    idempotency = Idempotency(
        sessions,
        locks,
        retention=timedelta(seconds=settings.idempotency_retention_s),
        # A request cannot outlive its timeout, so neither need its lock.
        lock_ttl_s=settings.request_timeout_s + 30,
    )
    return Runtime(
        settings=settings,
        db=db,
        direct=direct,
        generations=generations,
        sqlite_generation=sqlite_generation,
        sessions=sessions,
        recorder=recorder,
        admission=admission,
        idempotency=idempotency,
        tasks=tasks,
        auth_failures=auth_failures,
        blobs=open_blob_store(settings),
    )


def open_admission(
    settings: Settings, sessions: async_sessionmaker[AsyncSession], stack: AsyncExitStack
) -> Admission:
    """Quotas (their store closes last), the rebuild of this period's spend from the
    ledger (every start runs one) and the reconciler's upkeep."""
    max_life_s = settings.request_timeout_s + 30
    store = open_quota_store(settings.redis_url, guarded=True)
    admission = Admission(store, DEFAULT_PRICE, lease_s=settings.lease_s, max_life_s=max_life_s)
    _started(stack, admission)
    rebuilder = Rebuilder(sessions, store, settings.lease_s, max_life_s)
    stack.push_async_callback(rebuilder.close)
    admission.rebuilds = rebuilder
    rebuilder.ensure()
    _started(stack, Upkeep(rebuilder).periodic())
    return admission


async def attach_engine(
    runtime: Runtime,
    telemetry: Telemetry,
    stack: AsyncExitStack,
    engine_client: EngineClient | None,
) -> None:
    """The engine the runtime dispatches to: `engine_client` if given (the caller's to
    close), else one connected here and closed by `stack`."""
    if engine_client is None:
        engine_client = await connect_engine(runtime.settings)
        stack.push_async_callback(engine_client.close)
    runtime.engine_client = engine_client
    runtime.model_loaded_at = int(time.time())
    if isinstance(engine_client, InProcessEngineClient):
        telemetry.metrics.watch_engine(engine_client.engine.stats)
    log.info("engine ready: model %s", engine_client.model_name)


async def attach_models(runtime: Runtime, telemetry: Telemetry, stack: AsyncExitStack) -> None:
    """Every model the gateway serves: the engine above as the default entry, and the
    registry's models, re-read every few seconds (their clients closed by `stack`)."""
    metrics = telemetry.metrics
    build = client_builder(runtime.settings, metrics.disagreement, metrics.overclaim)
    models = ModelDirectory(runtime.sessions, build, runtime.engine_client, runtime.model_loaded_at)
    stack.push_async_callback(models.close)
    try:
        await models.refresh()
    except SQLAlchemyError as exc:  # the database may come up later: the refresh retries
        log.warning("the model registry cannot be read yet (%s)", type(exc).__name__)
    _started(stack, models.periodic())
    runtime.models = models
