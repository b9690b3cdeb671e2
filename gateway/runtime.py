"""What a running gateway holds: settings, database, engine client and the recorder."""

from __future__ import annotations

from dataclasses import dataclass, field

from litestar.datastructures import State
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from gateway.admission.auth_failures import AuthFailureLog
from gateway.admission.idempotency import Idempotency
from gateway.admission.key_cache import KeyCache
from gateway.admission.key_generation import GenerationListener, SqliteGeneration
from gateway.admission.quota import Admission
from gateway.core.errors import EngineUnavailable
from gateway.core.tasks import TaskSet
from gateway.dispatch.directory import ModelDirectory
from gateway.dispatch.engine_client import EngineClient
from gateway.metering.recorder import UsageRecorder
from gateway.settings import Settings
from tenants.adapters import Adapter
from tenants.blobs import BlobStore


@dataclass
class Runtime:
    settings: Settings
    db: AsyncEngine
    direct: AsyncEngine  # autocommit, no ping: one round trip a read or a pipeline (tenants.db)
    sessions: async_sessionmaker[AsyncSession]
    recorder: UsageRecorder
    idempotency: Idempotency
    admission: Admission
    tasks: TaskSet
    engine_client: EngineClient | None = None
    model_loaded_at: int = 0  # Unix time the engine (its model) was attached: /v1/models' created
    auth_failures: AuthFailureLog | None = None  # counted, audited once per window
    keys: KeyCache = field(default_factory=KeyCache)  # authenticated keys, for seconds
    generations: GenerationListener | None = None  # the key generation, notified (PostgreSQL)
    sqlite_generation: SqliteGeneration | None = None  # read on the loop's connection (SQLite)
    models: ModelDirectory | None = None  # every model served: the default and the registry's
    blobs: BlobStore | None = None  # uploaded files' bytes (data folder or S3); set at start

    @property
    def engine(self) -> EngineClient:
        if self.engine_client is None or not self.engine_client.is_ready():
            raise EngineUnavailable("the model is not loaded yet", headers={"Retry-After": "1"})
        return self.engine_client

    @property
    def directory(self) -> ModelDirectory:
        """Every model served; 503 until the app's start has built it."""
        if self.models is None:
            raise EngineUnavailable("the models are not loaded yet", headers={"Retry-After": "1"})
        return self.models

    @property
    def file_blobs(self) -> BlobStore:
        if self.blobs is None:
            raise RuntimeError("the runtime was opened without its file store")
        return self.blobs

    def engine_for(self, model: str) -> EngineClient:
        """The client serving `model` (404 when none does), 503 until it is ready."""
        return _ready(model, self.directory.get(model))

    def serving(self, model: str, tenant_id: str) -> tuple[EngineClient, Adapter | None]:
        """The client serving `model` for this tenant, and its LoRA adapter when `model`
        names one of the tenant's own (another tenant's is a 404, as an unknown model)."""
        client, adapter = self.directory.resolve(model, tenant_id)
        return _ready(model, client), adapter


def _ready(model: str, client: EngineClient) -> EngineClient:
    """503 until the client is ready."""
    if not client.is_ready():
        raise EngineUnavailable(
            f"the model {model!r} is not ready yet", headers={"Retry-After": "1"}
        )
    return client


def provide_runtime(state: State) -> Runtime:
    runtime: Runtime = state.runtime
    return runtime
