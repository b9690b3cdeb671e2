"""schemathesis over the gateway's own OpenAPI schema (issue 18 item 6, issue 13's fuzz
suite): for 60 s, requests generated from /schema/openapi.json, valid and invalid, are
sent with a valid admin key to a gateway on loopback; no answer may be a 5xx, nor have a
status, content type or body that the schema does not document."""

from __future__ import annotations

import asyncio
import re
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from gateway.app import create_app
from gateway.dispatch.engine_client import InProcessEngineClient
from gateway.settings import Settings
from tenants import db
from tenants.limits import LimitSet
from tenants.models import KeyRole, UsageEvent, UsageStatus
from tenants.services import ApiKeyService, TenantService
from tests.conftest import serving

pytestmark = pytest.mark.slow
BUDGET_S = 60
CHECKS = ",".join(
    ("not_a_server_error", "status_code_conformance", "content_type_conformance",
     "response_schema_conformance")
)  # fmt: skip


async def admin_key(url: str) -> str:
    """An admin key (it may call every route) whose requests generate a few tokens at
    most, so the fuzzer's time goes on requests, not on the tiny model's output."""
    engine = db.create_engine(url)
    async with db.session_factory(engine).begin() as session:
        tenant = await TenantService(session).create("fuzzer")
        created = await ApiKeyService(session).create(tenant, "schemathesis", KeyRole.ADMIN)
        await ApiKeyService(session).set_limits(created.key.id, LimitSet(max_tokens_per_request=8))
    await engine.dispose()
    return created.secret


async def ledger_outcomes(url: str) -> Counter[tuple[str, str, str | None]]:
    """(endpoint, status, error) of every ledger row the fuzzer's requests left."""
    engine = db.create_engine(url)
    async with db.session_factory(engine)() as session:
        rows = await session.execute(
            select(UsageEvent.endpoint, UsageEvent.status, UsageEvent.error)
        )
    await engine.dispose()
    return Counter((endpoint, UsageStatus(status).value, error) for endpoint, status, error in rows)


async def reached_endpoints(url: str) -> set[str]:
    """The endpoints of which the fuzzer got a request past admission (a ledger row: it
    ran on the engine, whatever its end; a refusal leaves none)."""
    return {endpoint for endpoint, _, _ in await ledger_outcomes(url)}


def only_missed_deadlines(report: str) -> bool:
    """Whether every failure schemathesis reports is a 504 deadline_exceeded: the
    documented answer to a `ttft_deadline_ms` the server could not meet (a generated 2 ms
    deadline is met on a fast machine and missed on a slow one), which its server-error
    check counts like any other 5xx."""
    failures = report.split("FAILURES", 1)[-1].split("WARNINGS", 1)[0]
    kinds = set(re.findall(r"^\s*- (ST\d+ .+)$", failures, re.MULTILINE))
    statuses = re.findall(r"^\s*\[(\d{3})\]", failures, re.MULTILINE)
    bodies = re.findall(r"`(\{.*\})`", failures)
    return (
        kinds == {"ST101 Server error"}
        and bool(statuses)
        and set(statuses) == {"504"}
        and len(bodies) == len(statuses)
        and all('"code":"deadline_exceeded"' in body for body in bodies)
    )


@pytest.fixture
def database(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'tollgate.db'}"
    db.upgrade(url)
    return url


async def test_schema_is_served_with_its_shapes(
    database: str, tmp_path: Path, engine_client: InProcessEngineClient
) -> None:
    settings = replace(Settings.from_env({}), database_url=database, data_dir=tmp_path / "data")
    app = create_app(settings, engine_client=engine_client)
    async with serving(app) as base, httpx.AsyncClient(base_url=base) as client:
        document = (await client.get("/schema/openapi.json")).json()
        page = await client.get("/schema")
    chat = document["paths"]["/v1/chat/completions"]["post"]
    body = chat["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    assert set(chat["responses"]) >= {"200", "400", "401", "403", "404", "409", "429", "503"}
    assert "text/event-stream" in chat["responses"]["200"]["content"]
    schemas = document["components"]["schemas"]
    assert schemas["ErrorResponse"]["required"] == ["error"]
    assert "messages" in schemas["ChatCompletionRequest"]["required"]
    served = [engine_client.model_name]  # a request names a model served now
    for request in ("ChatCompletionRequest", "CompletionRequest", "EmbeddingRequest"):
        assert schemas[request]["properties"]["model"]["enum"] == served
    assert {"/v1/responses", "/v1/embeddings", "/health", "/admin/api/models"} <= set(
        document["paths"]
    )
    assert not [
        path
        for path in document["paths"]
        if not path.startswith(("/v1", "/admin/api", "/health", "/readyz"))
    ]
    streams = {
        "/v1/chat/completions": "ChatCompletionChunk",
        "/v1/completions": "Completion",
        "/v1/responses": "ResponseEvent",
    }
    for path in (*streams, "/v1/embeddings"):
        operation = document["paths"][path]["post"]
        (header,) = [p for p in operation["parameters"] if p["name"] == "Idempotency-Key"]
        assert (header["in"], header["required"]) == ("header", False)
        assert "409" in operation["responses"] and "422" in operation["responses"]
        assert "Idempotency-Key" in operation["responses"]["422"]["description"]
    for path, chunk in streams.items():
        answer = document["paths"][path]["post"]["responses"]["200"]["content"]
        data = answer["text/event-stream"]["schema"]["properties"]["data"]
        assert data["contentMediaType"] == "application/json"
        assert {"$ref": f"#/components/schemas/{chunk}"} in data["contentSchema"]["oneOf"]
        assert chunk in schemas and "StreamError" in schemas
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "POST <code>/v1/chat/completions</code>" in page.text
    assert "cdn" not in page.text.lower() and "<script" not in page.text


@pytest.mark.timeout(BUDGET_S + 180)
async def test_schemathesis_finds_no_server_error_and_no_undocumented_answer(
    database: str, tmp_path: Path, engine_client: InProcessEngineClient
) -> None:
    settings = replace(Settings.from_env({}), database_url=database, data_dir=tmp_path / "data")
    key = await admin_key(database)
    async with serving(create_app(settings, engine_client=engine_client)) as base:
        command = [
            sys.executable, "-m", "schemathesis.cli", "run", f"{base}/schema/openapi.json",
            "--header", f"Authorization: Bearer {key}",
            "--checks", CHECKS,
            "--max-time", str(BUDGET_S),
            "--workers", "1",
            "--seed", "18",  # the same cases each run, so a failure reproduces
            "--request-timeout", "30",
            "--generation-database", "none",
            "--suppress-health-check", "all",
            "--no-color",
        ]  # fmt: skip
        process = await asyncio.create_subprocess_exec(
            *command,
            cwd=tmp_path,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        output, _ = await process.communicate()
    report = output.decode()
    assert process.returncode == 0 or only_missed_deadlines(report), report
    tested = re.search(r"Selected: (\d+)/\d+\s+Tested: (\d+)", report)
    assert tested is not None and tested[1] == tested[2], report  # every operation ran
    assert re.search(r"\d+ generated, \d+ (passed|found)", report), report
    # The served model's name is in the schema, so generation is reached, not only refused.
    reached = await reached_endpoints(database)
    assert reached & {"chat.completions", "completions", "responses"}, (
        await ledger_outcomes(database),
        report[-3000:],
    )
