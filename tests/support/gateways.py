"""Gateways served by uvicorn in the test's own event loop (unlike AsyncTestClient, whose
app runs in a thread of its own), so a test can wait on what the app's tasks set."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx
from litestar import Litestar
from sqlalchemy import text

from gateway.admission.key_generation import GenerationListener
from gateway.app import create_app
from gateway.dispatch.engine_client import EngineClient
from gateway.runtime import Runtime
from gateway.settings import Settings
from tests.conftest import serving

NOTIFIED_WITHIN_S = 10.0  # a bound on a wait for an event, never a pause


@dataclass
class Gateway:
    app: Litestar
    http: httpx.AsyncClient

    @property
    def runtime(self) -> Runtime:
        runtime: Runtime = self.app.state.runtime
        return runtime

    async def status(self, secret: str) -> int:
        """The status of an authenticated request that writes no ledger row."""
        headers = {"Authorization": f"Bearer {secret}"}
        return (await self.http.get("/v1/models", headers=headers)).status_code


@contextlib.asynccontextmanager
async def gateway(settings: Settings, engine_client: EngineClient) -> AsyncIterator[Gateway]:
    """A gateway on loopback; on PostgreSQL, once its key generation listener is live."""
    app = create_app(settings, engine_client=engine_client)
    async with serving(app) as base_url, httpx.AsyncClient(base_url=base_url) as http:
        served = Gateway(app, http)
        if served.runtime.generations is not None:
            await until(served.runtime.generations, lambda generation: generation is not None)
        yield served


async def until(listener: GenerationListener, check: Callable[[int | None], bool]) -> None:
    async with asyncio.timeout(NOTIFIED_WITHIN_S):
        await listener.until(check)


async def notified(served: Gateway, before: int | None) -> None:
    """Until the gateway has taken a key generation newer than `before` (read when the
    change was made), or reads it per request (no listener, or a blind one)."""
    listener = served.runtime.generations
    if listener is not None and before is not None:
        await until(listener, lambda now: now is None or now > before)


async def terminate_connections(sessions: Any, application_name: str) -> int:
    """Close every connection of one pool to this database, as a database restart does
    (`application_name` tells the pool's connections apart); returns how many."""
    async with sessions() as session:
        killed = await session.scalar(
            text(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE datname = current_database() AND application_name = :name"
            ),
            {"name": application_name},
        )
    return int(killed or 0)
