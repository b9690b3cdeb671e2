"""Liveness and readiness probes (no authentication: they reveal nothing)."""

from __future__ import annotations

from typing import Any

from litestar import MediaType, Request, Response, get
from litestar.di import NamedDependency
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.http.deps import MaybeEngine
from gateway.openapi import documented
from gateway.openapi.shapes import Health, Readiness

PROBE = documented(Health, secured=False, also={503: ("The engine has died", Health)})
READINESS = documented(
    Readiness, secured=False, also={503: ("Draining, or a check failed", Readiness)}
)


# /health: what guidellm and vLLM-style probes call
@get(["/healthz", "/health"], media_type=MediaType.JSON, tags=["Probes"], operation_class=PROBE)
async def healthz(
    engine_client: MaybeEngine,
) -> Response[dict[str, str]]:
    """The process is up and serving HTTP, and no engine it runs has died (a dead
    in-process engine would otherwise answer 503 to every tenant until restarted)."""
    if engine_client is not None and not engine_client.is_alive():
        return Response({"status": "engine_dead"}, status_code=503)
    return Response({"status": "ok"})


@get("/readyz", media_type=MediaType.JSON, tags=["Probes"], operation_class=READINESS)
async def readyz(
    request: Request[Any, Any, Any],
    database: NamedDependency[AsyncEngine],
    engine_client: MaybeEngine,
) -> Response[dict[str, Any]]:
    """Ready for traffic: not draining (SIGTERM, gateway/cli/drain.py), the database answers
    and the engine is running."""
    engine_ok = engine_client is not None and engine_client.is_ready()
    checks = {"database": await _database_ok(database), "engine": engine_ok}
    drain = request.app.state.get("drain")
    if drain is not None and drain.draining:  # out of rotation first, whatever else holds
        return Response({"status": "draining", "checks": checks}, status_code=503)
    ready = all(checks.values())
    body = {"status": "ready" if ready else "not_ready", "checks": checks}
    return Response(body, status_code=200 if ready else 503)


async def _database_ok(database: AsyncEngine) -> bool:
    try:
        async with database.connect() as connection:
            await connection.execute(text("SELECT 1"))
    except Exception:
        return False
    return True
