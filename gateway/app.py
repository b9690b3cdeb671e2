"""The Litestar app factory. Nothing happens at import time; settings are read here."""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta

from litestar import Litestar
from litestar.di import Provide

from backend import EngineConfig
from backend.builtin import BUILTIN_MODEL_DIR
from gateway.admin.audit import AuditController
from gateway.admin.controllers import AdminController
from gateway.admission.auth import echo_request_id
from gateway.admission.auth_failures import AuthFailureLog
from gateway.admission.idempotency import Idempotency
from gateway.admission.quota import Admission
from gateway.admission.reconcile import Rebuilder, Upkeep
from gateway.api.health import healthz, readyz
from gateway.api.openai import OpenAIController
from gateway.billing.controllers import BillingAdminController, UsageController
from gateway.billing.jobs import BillingJobs
from gateway.console import console_router
from gateway.deps import REQUEST_DEPENDENCIES
from gateway.dispatch import discovery
from gateway.dispatch.engine_client import EngineClient, InProcessEngineClient
from gateway.errors import exception_handlers
from gateway.metering import UsageRecorder
from gateway.runtime import Runtime, provide_runtime
from gateway.settings import Settings
from gateway.tasks import TaskSet
from gateway.telemetry import Telemetry
from gateway.telemetry.endpoint import metrics
from tenants.billing.prices import PriceBook
from tenants.db import create_engine, session_factory
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
    telemetry = Telemetry.from_env(os.environ)  # /metrics access, tenant label bound

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        db = create_engine(settings.database_url)
        sessions = session_factory(db)
        redis = connect_redis(settings.redis_url) if settings.redis_url else None
        locks: InFlightLocks = RedisLocks(redis) if redis is not None else MemoryLocks()
        tasks = TaskSet()
        max_life_s = settings.request_timeout_s + 30
        admission = Admission(
            open_quota_store(settings.redis_url, guarded=True),
            DEFAULT_PRICE,
            lease_s=settings.lease_s,
            max_life_s=max_life_s,
        )
        rebuilder = Rebuilder(sessions, admission.store, settings.lease_s, max_life_s)
        admission.rebuilds = rebuilder
        admission.start()
        rebuilder.ensure()  # every start rebuilds this period's spend from the ledger
        upkeep = Upkeep(sessions, admission.store, settings.lease_s, rebuilder).periodic()
        upkeep.start()
        billing_jobs = BillingJobs(settings, sessions).periodic()
        if BillingJobs.wanted(settings):
            billing_jobs.start()
        export_health = BillingJobs(settings, sessions).health(telemetry.metrics.registry)
        export_health.start()
        auth_failures = AuthFailureLog(sessions)
        auth_failures.start()
        recorder = UsageRecorder(
            sessions, PriceBook(sessions), tasks, admission, settings.checkpoint_ms / 1000
        )
        recorder.start()  # checkpoints of running streams
        orphans = recorder.periodic()
        orphans.start()
        runtime = Runtime(
            settings=settings,
            db=db,
            sessions=sessions,
            recorder=recorder,
            admission=admission,
            idempotency=Idempotency(
                sessions,
                locks,
                retention=timedelta(seconds=settings.idempotency_retention_s),
                # A request cannot outlive its timeout, so neither need its lock.
                lock_ttl_s=settings.request_timeout_s + 30,
            ),
            tasks=tasks,
            auth_failures=auth_failures,
        )
        app.state.runtime = runtime
        app.state.telemetry = telemetry
        owned = engine_client is None
        runtime.engine_client = engine_client or await connect_engine(settings)
        if isinstance(runtime.engine_client, InProcessEngineClient):
            telemetry.metrics.watch_engine(runtime.engine_client.engine.stats)
        log.info("engine ready: model %s", runtime.engine_client.model_name)
        try:
            yield
        finally:
            await tasks.drain()
            await orphans.close()
            await recorder.close()
            await upkeep.close()
            await rebuilder.close()
            await billing_jobs.close()
            await export_health.close()
            await auth_failures.close()
            await admission.close()
            if owned:
                await runtime.engine_client.close()
            if redis is not None:
                await redis.aclose()
            await db.dispose()

    return Litestar(
        route_handlers=[
            OpenAIController,
            AdminController,
            UsageController,
            BillingAdminController,
            AuditController,
            console_router(),
            healthz,
            readyz,
            metrics,
        ],
        middleware=[telemetry.middleware],
        dependencies={
            "runtime": Provide(provide_runtime, sync_to_thread=False),
            **REQUEST_DEPENDENCIES,
        },
        exception_handlers=exception_handlers(),
        lifespan=[lifespan],
        before_send=[echo_request_id],
        openapi_config=None,
        request_max_body_size=settings.max_body_bytes,
        logging_config=None,  # the process's logging (JSON lines) is set by `tollgate serve`
        debug=False,
    )
