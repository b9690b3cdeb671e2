"""One request id end to end: the x-request-id of every answer, errors included, is the
id of its ledger row (when it has one)."""

from __future__ import annotations

from dataclasses import replace

import httpx
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.app import create_app
from gateway.dispatch.engine_client import InProcessEngineClient
from gateway.settings import Settings
from tenants.models import UsageEvent
from tests.conftest import eventually, serving
from tests.integration.conftest import Lines


async def test_an_error_answer_names_its_ledger_row(
    log_lines: Lines,
    settings: Settings,
    engine_client: InProcessEngineClient,
    tenant_key: str,
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    app = create_app(replace(settings, request_timeout_s=0.05), engine_client=engine_client)
    body = {"model": engine_client.model_name, "prompt": "The", "max_tokens": 1000}
    async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        timed_out = await http.post(
            "/v1/completions",
            json=body | {"ignore_eos": True},  # cannot finish in 50 ms
            headers={"Authorization": f"Bearer {tenant_key}"},
        )
        unauthenticated = await http.post("/v1/completions", json=body)
    assert timed_out.status_code == 504
    request_id = timed_out.headers["x-request-id"]

    async def row_status() -> str | None:
        async with sessions() as session:
            query = select(UsageEvent.status).where(UsageEvent.request_id == request_id)
            return await session.scalar(query)

    await eventually(row_status)
    assert await row_status() == "rejected"  # refused by its deadline, nothing sent
    assert unauthenticated.status_code == 401
    assert unauthenticated.headers["x-request-id"].startswith("req_")
    # Each answer's "request finished" line names the id its client got.
    finished = [e for e in log_lines.entries if e["message"] == "request finished"]
    assert [(e["http_status"], e.get("request_id")) for e in finished] == [
        (504, request_id),
        (401, unauthenticated.headers["x-request-id"]),
    ]
