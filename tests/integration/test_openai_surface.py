"""The small print of the OpenAI surface: errors SDKs act on (x-should-retry), a client
that leaves mid-upload (a 499, never a 500), request ids on every answer and in its log
line and span, the exact /metrics content type, tenant names as labels, /health and the
model's `created`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from urllib.parse import urlsplit

import httpx
import openai
import pytest
from litestar import Litestar
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.app import create_app
from gateway.dispatch.engine_client import InProcessEngineClient
from gateway.settings import Settings
from tenants.limits import LimitSet
from tests.conftest import eventually, serving
from tests.integration.conftest import Lines
from tests.integration.test_openai_compat import database_url  # noqa: F401 (a fixture)
from tests.integration.test_quotas import _tenant_key

Sessions = async_sessionmaker[AsyncSession]


def _finished(lines: Lines) -> list[dict[str, object]]:
    return [e for e in lines.entries if e["message"] == "request finished"]


@pytest.fixture
async def server(
    settings: Settings, engine_client: InProcessEngineClient
) -> AsyncIterator[tuple[Litestar, str]]:
    app = create_app(replace(settings, max_body_bytes=2**12), engine_client=engine_client)
    async with serving(app) as url:
        yield app, url


def _chat(model: str) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


async def test_the_sdk_does_not_retry_an_exhausted_budget_but_retries_a_rate_limit(
    server: tuple[Litestar, str],
    engine_client: InProcessEngineClient,
    sessions: Sessions,
    log_lines: Lines,
) -> None:
    _, url = server
    _, broke = await _tenant_key(sessions, LimitSet(monthly_budget_micros=1))
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=broke, max_retries=2)
    with pytest.raises(openai.RateLimitError) as refused:
        await client.chat.completions.create(**_chat(engine_client.model_name))  # type: ignore[call-overload]
    assert refused.value.response.headers["x-should-retry"] == "false"
    assert refused.value.code == "insufficient_quota"
    assert len(_finished(log_lines)) == 1  # one request reached the server: no retries
    async with httpx.AsyncClient(base_url=url) as http:
        _, limited_key = await _tenant_key(sessions, LimitSet(rpm=1))
        auth = {"Authorization": f"Bearer {limited_key}"}
        body = _chat(engine_client.model_name)
        assert (await http.post("/v1/chat/completions", json=body, headers=auth)).is_success
        limited = await http.post("/v1/chat/completions", json=body, headers=auth)
    assert limited.status_code == 429 and "retry-after" in limited.headers
    assert "x-should-retry" not in limited.headers
    assert limited.json()["error"]["type"] == "rate_limit_error"


async def test_a_client_gone_mid_upload_is_a_499_not_an_internal_error(
    server: tuple[Litestar, str],
    tenant_key: str,
    log_lines: Lines,
    spans: InMemorySpanExporter,
) -> None:
    app, url = server
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {tenant_key}\r\nContent-Length: 1000\r\n\r\n".encode()
        + b'{"model": "m", "messages": ['
    )
    await writer.drain()
    await eventually(
        lambda: any(s.kind == SpanKind.SERVER for s in spans.get_finished_spans()) or True
    )
    writer.close()  # half the body sent: the client is gone
    await writer.wait_closed()
    await eventually(lambda: _finished(log_lines))
    [line] = _finished(log_lines)
    assert line["http_status"] == 499
    [root] = [s for s in spans.get_finished_spans() if s.kind == SpanKind.SERVER]
    assert (root.attributes or {})["http.response.status_code"] == 499
    assert (root.attributes or {})["error.type"] == "client_closed"
    metrics = app.state.telemetry.metrics.exposition().decode()
    assert 'reason="client_closed"' in metrics and 'reason="internal"' not in metrics
    del reader


async def test_every_refusal_has_its_id_in_its_log_line_and_span(
    server: tuple[Litestar, str],
    tenant_key: str,
    engine_client: InProcessEngineClient,
    log_lines: Lines,
    spans: InMemorySpanExporter,
) -> None:
    _, url = server
    auth = {"Authorization": f"Bearer {tenant_key}"}
    async with httpx.AsyncClient(base_url=url) as http:
        answers = [
            await http.post("/v1/chat/completions", content=b"{", headers=auth),  # 400
            await http.post("/v1/chat/completions", json=_chat(engine_client.model_name)),  # 401
            await http.get("/v1/nowhere", headers=auth),  # 404
            await http.post("/v1/completions", content=b"x" * 2**13, headers=auth),  # 413
            await http.delete("/v1/completions", headers=auth),  # 405
        ]
    statuses = [400, 401, 404, 413, 405]
    assert [a.status_code for a in answers] == statuses
    ids = [a.headers["x-request-id"] for a in answers]
    assert [(e["http_status"], e["request_id"]) for e in _finished(log_lines)] == list(
        zip(statuses, ids, strict=True)
    )
    roots = [s for s in spans.get_finished_spans() if s.kind == SpanKind.SERVER]
    assert [(s.attributes or {}).get("tollgate.request_id") for s in roots] == ids
    codes = [(a.json()["error"]["type"], a.json()["error"]["code"]) for a in answers[3:]]
    assert codes == [
        ("invalid_request_error", "request_too_large"),
        ("invalid_request_error", "method_not_allowed"),
    ]


async def test_a_callers_request_id_is_kept_and_a_malformed_one_replaced(
    server: tuple[Litestar, str],
    tenant_key: str,
    engine_client: InProcessEngineClient,
    log_lines: Lines,
    spans: InMemorySpanExporter,
) -> None:
    _, url = server
    mine = "trace 42/abc:" + "x" * 100
    auth = {"Authorization": f"Bearer {tenant_key}"}
    async with httpx.AsyncClient(base_url=url) as http:
        kept = await http.post(
            "/v1/chat/completions",
            json=_chat(engine_client.model_name),
            headers={**auth, "x-request-id": mine},
        )
        replaced = await http.get("/v1/models", headers={**auth, "x-request-id": "y" * 129})
    assert kept.status_code == 200 and kept.headers["x-request-id"] == mine
    ours = kept.headers["x-tollgate-request-id"]  # the ledger's id, beside the caller's
    assert ours.startswith("req_") and kept.json()["id"].endswith(ours.removeprefix("req_"))
    assert replaced.headers["x-request-id"].startswith("req_")
    first = _finished(log_lines)[0]
    assert (first["client_request_id"], first["request_id"]) == (mine, ours)
    root = next(s for s in spans.get_finished_spans() if s.kind == SpanKind.SERVER)
    assert (root.attributes or {})["tollgate.client_request_id"] == mine


async def test_metrics_health_and_models(
    server: tuple[Litestar, str], tenant_key: str, engine_client: InProcessEngineClient
) -> None:
    _, url = server
    before = int(time.time())
    auth = {"Authorization": f"Bearer {tenant_key}"}
    async with httpx.AsyncClient(base_url=url) as http:
        assert (await http.post("/v1/chat/completions", json=_chat(engine_client.model_name),
                                headers=auth)).status_code == 200  # fmt: skip
        scraped = await http.get("/metrics")
        health = await http.get("/health")
        models = (await http.get("/v1/models", headers=auth)).json()
    assert scraped.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert 'tenant="acme"' in scraped.text  # the name, not the id
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert before - 60 <= models["data"][0]["created"] <= int(time.time())
