"""The composition root: what a running gateway holds (settings, database, stores, engine
clients, the recorder), wired once by the app factory, and the providers that hand each
handler the services it asks for by name. Only the app factory and its start-up code
import this module; routes and services receive what they use."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from litestar.datastructures import State
from litestar.di import Provide
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from gateway.admission.auth_failures import AuthFailureLog
from gateway.admission.authentication import KeyAuthentication
from gateway.admission.idempotency import Idempotency
from gateway.admission.key_cache import KeyCache
from gateway.admission.key_generation import GenerationListener, SqliteGeneration
from gateway.admission.quota import Admission
from gateway.api.services import GenerationServices
from gateway.core.errors import EngineUnavailable
from gateway.core.tasks import TaskSet
from gateway.dispatch.directory import ModelDirectory
from gateway.dispatch.engine_client import EngineClient
from gateway.http.deps import provide_db_session
from gateway.metering.recorder import UsageRecorder
from gateway.settings import Settings
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

    def authentication(self) -> KeyAuthentication:
        known = self.generations or self.sqlite_generation
        return KeyAuthentication(self.sessions, self.direct, self.keys, known, self.auth_failures)

    def generation_services(self) -> GenerationServices:
        services = (self.admission, self.idempotency, self.recorder, self.tasks)
        return GenerationServices(self.settings, self.directory, *services)


def _from_runtime(read: Callable[[Runtime], Any]) -> Provide:
    """A provider of what `read` takes from the app's runtime, read at each request: what
    the start attaches later (the engine, the models) and a test's changes are seen."""

    def provide(state: State) -> Any:
        return read(state.runtime)

    return Provide(provide, sync_to_thread=False)


def dependencies() -> dict[str, Provide]:
    """Every service a handler may ask for, by the name of its parameter."""
    return {
        "settings": _from_runtime(lambda r: r.settings),
        "sessions": _from_runtime(lambda r: r.sessions),
        "database": _from_runtime(lambda r: r.db),
        "engine_client": _from_runtime(lambda r: r.engine_client),  # None until attached
        "directory": _from_runtime(lambda r: r.directory),
        "authentication": _from_runtime(Runtime.authentication),
        "quota_store": _from_runtime(lambda r: r.admission.store),
        "prices": _from_runtime(lambda r: r.recorder.prices),
        "services": _from_runtime(Runtime.generation_services),
        "file_blobs": _from_runtime(lambda r: r.file_blobs),
        "db_session": Provide(provide_db_session),
    }
