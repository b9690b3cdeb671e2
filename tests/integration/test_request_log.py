"""One log line per request: the gateway's "request finished" line carries what uvicorn's
access line did (method, path, status, duration, client), for /v1 and for everything
else (the admin API, probes), and `tollgate serve` runs uvicorn without its access log."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

import httpx
import pytest
import uvicorn
from litestar import Litestar
from litestar.testing import AsyncTestClient

from gateway.app import create_app
from gateway.cli.serve import gateway_config
from gateway.dispatch.engine_client import InProcessEngineClient
from gateway.settings import Settings
from gateway.telemetry.logs import TextFormatter
from tests.conftest import eventually
from tests.integration.conftest import Lines

pytestmark = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)


async def test_every_request_gets_one_line_and_uvicorn_writes_none(
    log_lines: Lines, settings: Settings, engine_client: InProcessEngineClient, tenant_key: str
) -> None:
    access = Lines()  # what uvicorn's access logger would write
    access_logger = logging.getLogger("uvicorn.access")
    access_logger.addHandler(access)
    level = access_logger.level
    access_logger.setLevel(logging.INFO)
    app = create_app(settings, engine_client=engine_client)
    config = gateway_config(app, replace(settings, host="127.0.0.1", port=0))
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        await eventually(lambda: server.started or task.done())
        assert server.started, "uvicorn did not start"
        port = server.servers[0].sockets[0].getsockname()[1]
        bearer = {"Authorization": f"Bearer {tenant_key}"}
        body = {"model": engine_client.model_name, "prompt": "The", "max_tokens": 1}
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            generated = await http.post("/v1/completions", json=body, headers=bearer)
            probe = await http.get("/healthz")
            admin = await http.get("/admin/api/tenants?limit=5", headers=bearer)  # not an admin
    finally:
        server.should_exit = True
        await task
        access_logger.removeHandler(access)
        access_logger.setLevel(level)
    assert (generated.status_code, probe.status_code, admin.status_code) == (200, 200, 403)
    finished = [e for e in log_lines.entries if e["message"] == "request finished"]
    assert [(e["http_method"], e["http_path"], e["http_status"]) for e in finished] == [
        ("POST", "/v1/completions", 200),
        ("GET", "/healthz", 200),
        ("GET", "/admin/api/tenants", 403),  # the query string is left out
    ]
    assert [e["request_id"] for e in finished] == [
        generated.headers["x-request-id"],
        probe.headers["x-request-id"],
        admin.headers["x-request-id"],
    ]
    for entry in finished:
        assert isinstance(entry["duration_ms"], float) and entry["duration_ms"] >= 0
        assert entry["client_ip"] == "127.0.0.1"
    assert access.entries == []


class TextLines(logging.Handler):
    """The lines the server writes with TOLLGATE_LOG_FORMAT=text (made as they are logged,
    so the request id is the request's)."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []
        self.setFormatter(TextFormatter())

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


async def test_text_lines_carry_the_request_fields(
    client: AsyncTestClient[Litestar], engine_client: InProcessEngineClient, tenant_key: str
) -> None:
    """TOLLGATE_LOG_FORMAT=text wrote only "request finished": its line has the fields the
    JSON line has, as key=value."""
    lines, logger = TextLines(), logging.getLogger("tollgate.requests")
    logger.addHandler(lines)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        body = {"model": engine_client.model_name, "prompt": "The", "max_tokens": 1}
        headers = {"Authorization": f"Bearer {tenant_key}"}
        answer = await client.post("/v1/completions", json=body, headers=headers)
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
    assert answer.status_code == 200
    (line,) = [line for line in lines.lines if "request finished" in line]
    fields = dict(pair.split("=", 1) for pair in line.split(" request finished ")[1].split())
    assert (fields["http_method"], fields["http_path"], fields["http_status"]) == (
        "POST",
        "/v1/completions",
        "200",
    )
    assert fields["request_id"] == answer.headers["x-request-id"]
    assert fields["tenant_id"] and fields["tenant_id"] != "null"
    assert float(fields["duration_ms"]) >= 0
    assert tenant_key not in line
