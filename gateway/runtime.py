"""What a running gateway holds: settings, database, engine client and the recorder."""

from __future__ import annotations

from dataclasses import dataclass

from litestar.datastructures import State
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from gateway.admission.auth_failures import AuthFailureLog
from gateway.admission.idempotency import Idempotency
from gateway.admission.quota import Admission
from gateway.dispatch.engine_client import EngineClient
from gateway.errors import EngineUnavailable
from gateway.metering import UsageRecorder
from gateway.settings import Settings
from gateway.tasks import TaskSet


@dataclass
class Runtime:
    settings: Settings
    db: AsyncEngine
    sessions: async_sessionmaker[AsyncSession]
    recorder: UsageRecorder
    idempotency: Idempotency
    admission: Admission
    tasks: TaskSet
    engine_client: EngineClient | None = None
    model_loaded_at: int = 0  # Unix time the engine (its model) was attached: /v1/models' created
    auth_failures: AuthFailureLog | None = None  # counted, audited once per window

    @property
    def engine(self) -> EngineClient:
        if self.engine_client is None or not self.engine_client.is_ready():
            raise EngineUnavailable("the model is not loaded yet", headers={"Retry-After": "1"})
        return self.engine_client


def provide_runtime(state: State) -> Runtime:
    runtime: Runtime = state.runtime
    return runtime
