"""Traces, metrics and logs of real requests through the gateway and the engine.

Telemetry does not depend on the database kind, so these run on SQLite only.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from typing import Any

import httpx
import pytest
from litestar import Litestar, Request, post
from litestar.testing import AsyncTestClient
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.app import create_app
from gateway.dispatch.engine_client import InProcessEngineClient
from gateway.settings import Settings
from gateway.telemetry.logs import JsonFormatter
from tenants.limits import LimitSet, PlanTerms
from tenants.services import ApiKeyService, PlanService, TenantService
from tests.conftest import eventually, serving
from tests.e2e.processes import free_port, running, start

pytestmark = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)

METRICS_TOKEN = "metrics-" + secrets.token_hex(8)


@pytest.fixture
async def http(
    settings: Settings, engine_client: InProcessEngineClient
) -> AsyncIterator[AsyncTestClient[Litestar]]:
    app = create_app(replace(settings, metrics_token=METRICS_TOKEN), engine_client=engine_client)
    async with AsyncTestClient(app=app) as client:
        yield client


class LogLines(logging.Handler):
    """Every log record of the process, formatted as the JSON line a server would write."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(JsonFormatter())
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@pytest.fixture
def log_lines() -> Iterator[LogLines]:
    """Everything logged at DEBUG (as with TOLLGATE_LOG_LEVEL=debug)."""
    handler = LogLines()
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# Far more tokens than a cancelled request gets to make, even on a fast machine.
BUSY = 1000


def _chat(model: str, content: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 6,
        "ignore_eos": True,
        "temperature": 0,
        **extra,
    }


def _events(body: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]


def _root(exporter: InMemorySpanExporter, request_id: str) -> ReadableSpan | None:
    """The gateway's server span of the request."""
    return next(
        (
            span
            for span in exporter.get_finished_spans()
            if span.kind == SpanKind.SERVER
            and (span.attributes or {}).get("tollgate.request_id") == request_id
        ),
        None,
    )


def _trace(exporter: InMemorySpanExporter, root: ReadableSpan) -> list[ReadableSpan]:
    assert root.context is not None
    return [
        s
        for s in exporter.get_finished_spans()
        if s.context is not None and s.context.trace_id == root.context.trace_id
    ]


def _parents(spans: list[ReadableSpan]) -> dict[str, str]:
    """span name -> its parent's name (names are unique within one request's trace)."""
    by_id = {s.context.span_id: s.name for s in spans if s.context is not None}
    return {s.name: by_id[s.parent.span_id] for s in spans if s.parent is not None}


async def _trace_with(
    exporter: InMemorySpanExporter, request_id: str, names: set[str]
) -> tuple[ReadableSpan, list[ReadableSpan]]:
    def complete() -> bool:
        root = _root(exporter, request_id)
        return root is not None and names <= {s.name for s in _trace(exporter, root)}

    await eventually(complete)
    root = _root(exporter, request_id)
    assert root is not None
    return root, _trace(exporter, root)


async def test_streamed_request_span_tree(
    http: AsyncTestClient[Litestar],
    tenant_key: str,
    spans: InMemorySpanExporter,
    engine_client: InProcessEngineClient,
) -> None:
    payload = _chat(
        engine_client.model_name, "What does json.dumps do?",
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    headers = {**_auth(tenant_key), "Idempotency-Key": uuid.uuid4().hex}
    response = await http.post("/v1/chat/completions", json=payload, headers=headers)
    assert response.status_code == 200
    usage = _events(response.text)[-1]["usage"]
    request_id = response.headers["x-request-id"]

    engine_phases = {"engine.queue", "engine.prefill", "engine.decode", "engine.kv_release"}
    gateway_phases = {"authenticate", "idempotency", "admission", "dispatch", "stream", "settle"}
    root, trace_spans = await _trace_with(spans, request_id, engine_phases | gateway_phases)

    parents = _parents(trace_spans)
    root_name = f"chat {engine_client.model_name}"
    assert root.name == root_name
    assert root.kind == SpanKind.SERVER
    assert {name: parents[name] for name in gateway_phases} == dict.fromkeys(
        gateway_phases, root_name
    )
    assert {name: parents[name] for name in engine_phases} == dict.fromkeys(
        engine_phases, "dispatch"
    )
    assert "cancel" not in parents
    attributes = dict(root.attributes or {})
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.provider.name"] == "tollgate"
    assert attributes["gen_ai.request.model"] == engine_client.model_name
    assert attributes["gen_ai.request.stream"] is True
    assert attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 6
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert attributes["gen_ai.usage.cache_read.input_tokens"] == cached
    assert attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert attributes["tollgate.workload_class"] == "chat"
    assert attributes["tollgate.tenant.id"]
    assert isinstance(attributes["tollgate.request.priority"], int)
    assert attributes["http.response.status_code"] == 200
    named = {s.name: dict(s.attributes or {}) for s in trace_spans}
    assert named["engine.decode"]["gen_ai.usage.output_tokens"] == 6
    assert named["engine.prefill"]["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert named["engine.prefill"]["gen_ai.usage.cache_read.input_tokens"] == cached
    assert named["engine.prefill"]["tollgate.prefill.chunks"] == 1  # a short prompt: one step
    assert named["engine.kv_release"]["tollgate.kv.release_reason"] == "finished"
    assert named["stream"]["tollgate.stream.delivered_tokens"] == 6


async def test_a_callers_traceparent_is_joined(
    http: AsyncTestClient[Litestar],
    tenant_key: str,
    spans: InMemorySpanExporter,
    engine_client: InProcessEngineClient,
) -> None:
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    headers = {**_auth(tenant_key), "traceparent": f"00-{trace_id}-{parent_id}-01"}
    payload = {"model": engine_client.model_name, "prompt": "def", "max_tokens": 2}
    response = await http.post("/v1/completions", json=payload, headers=headers)
    assert response.status_code == 200
    root, _ = await _trace_with(spans, response.headers["x-request-id"], {"settle"})
    assert root.context is not None and root.parent is not None
    assert root.context.trace_id == int(trace_id, 16)
    assert root.parent.span_id == int(parent_id, 16)
    assert root.name == f"text_completion {engine_client.model_name}"


async def test_cancelled_stream_shows_cancel_and_kv_release(
    live_server: tuple[Litestar, str],
    tenant_key: str,
    spans: InMemorySpanExporter,
    engine_client: InProcessEngineClient,
) -> None:
    _, base = live_server
    payload = _chat(engine_client.model_name, "Return the", stream=True, max_tokens=BUSY)
    read = 0
    async with (
        httpx.AsyncClient(base_url=base) as client,
        client.stream(
            "POST", "/v1/chat/completions", json=payload, headers=_auth(tenant_key)
        ) as response,
    ):
        request_id = response.headers["x-request-id"]
        async for line in response.aiter_lines():
            read += line.startswith("data: {")
            if read == 4:
                break  # leaving the block closes the connection mid-stream

    phases = {"cancel", "engine.kv_release", "engine.decode", "settle", "stream"}
    root, trace_spans = await _trace_with(spans, request_id, phases)
    named = {s.name: dict(s.attributes or {}) for s in trace_spans}
    assert named["engine.kv_release"]["tollgate.kv.release_reason"] == "aborted"
    decoded = named["engine.decode"]["gen_ai.usage.output_tokens"]
    assert isinstance(decoded, int) and 0 < decoded < BUSY
    assert _parents(trace_spans)["cancel"] == root.name
    assert (root.attributes or {})["tollgate.outcome"] == "cancelled"


async def test_cancelled_whole_request_shows_cancel_and_kv_release(
    live_server: tuple[Litestar, str],
    tenant_key: str,
    spans: InMemorySpanExporter,
    engine_client: InProcessEngineClient,
) -> None:
    _, base = live_server
    payload = _chat(engine_client.model_name, "Return the", max_tokens=BUSY)
    await eventually(lambda: engine_client.engine.stats().num_running == 0)  # others' aborts
    async with httpx.AsyncClient(base_url=base) as client:
        call = asyncio.create_task(
            client.post("/v1/chat/completions", json=payload, headers=_auth(tenant_key))
        )
        await eventually(lambda: engine_client.engine.stats().num_running == 1)
        call.cancel()  # the client gives up: httpx closes the connection
        await asyncio.gather(call, return_exceptions=True)

    def root() -> ReadableSpan | None:
        return next((s for s in spans.get_finished_spans() if s.kind == SpanKind.SERVER), None)

    await eventually(root)
    found = root()
    assert found is not None
    request_id = str((found.attributes or {})["tollgate.request_id"])
    cancelled, trace_spans = await _trace_with(spans, request_id, {"cancel", "engine.kv_release"})
    named = {s.name: dict(s.attributes or {}) for s in trace_spans}
    assert named["engine.kv_release"]["tollgate.kv.release_reason"] == "aborted"
    assert (cancelled.attributes or {})["tollgate.outcome"] == "cancelled"
    assert "stream" not in named  # a whole response: nothing was streamed


def _metric_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [
        (sample.name, sample.labels, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    ]


def _total(samples: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    return sum(
        value
        for sample, have, value in samples
        if sample == name and all(have.get(k) == v for k, v in labels.items())
    )


async def test_metrics_count_every_request(
    http: AsyncTestClient[Litestar], tenant_key: str, engine_client: InProcessEngineClient
) -> None:
    model = engine_client.model_name
    made = 0
    for stream in (False, True, False):
        response = await http.post(
            "/v1/chat/completions",
            json=_chat(model, "Hello", stream=stream),
            headers=_auth(tenant_key),
        )
        assert response.status_code == 200
        made += 1
    completion = {"model": model, "prompt": "def", "max_tokens": 6, "ignore_eos": True}
    response = await http.post("/v1/completions", json=completion, headers=_auth(tenant_key))
    assert response.status_code == 200
    made += 1
    refused = await http.post("/v1/completions", json=completion, headers=_auth("tg-wrong"))
    assert refused.status_code == 401

    assert (await http.get("/metrics")).status_code == 401
    scraped = await http.get("/metrics", headers=_auth(METRICS_TOKEN))
    assert scraped.status_code == 200
    assert scraped.headers["content-type"].startswith("text/plain")
    samples = _metric_samples(scraped.text)
    for histogram in (
        "gen_ai_server_time_to_first_token_seconds",
        "gen_ai_server_time_per_output_token_seconds",
        "gen_ai_server_request_duration_seconds",
        "tollgate_queue_time_seconds",
    ):
        assert _total(samples, f"{histogram}_count") == made, histogram
    assert _total(samples, "gen_ai_server_request_duration_seconds_count",
                  workload_class="completion") == 1  # fmt: skip
    assert _total(samples, "tollgate_requests_total", status="completed") == made
    assert _total(samples, "tollgate_tokens_total", type="output") == 6 * made
    assert _total(samples, "tollgate_rejections_total", reason="authentication", tenant="none") == 1
    assert any(name == "tollgate_engine_kv_cache_usage_ratio" for name, _, _ in samples)
    tenants = {labels["tenant"] for name, labels, _ in samples if name == "tollgate_requests_total"}
    assert len(tenants) == 1 and "other" not in tenants
    assert _total(samples, "tollgate_tenant_budget_spent_micros") > 0  # settled, charged


async def test_budget_rejection_is_counted_with_its_reason(
    http: AsyncTestClient[Litestar],
    engine_client: InProcessEngineClient,
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    name = f"t{uuid.uuid4().hex[:12]}"
    async with sessions.begin() as session:
        await PlanService(session).create(name, PlanTerms(limits=LimitSet(monthly_budget_micros=1)))
        await TenantService(session).create(name)
        tenant = await TenantService(session).set_plan(name, name)
        key = (await ApiKeyService(session).create(tenant)).secret
    payload = _chat(engine_client.model_name, "Hello")
    response = await http.post("/v1/chat/completions", json=payload, headers=_auth(key))
    assert response.status_code == 429
    samples = _metric_samples((await http.get("/metrics", headers=_auth(METRICS_TOKEN))).text)
    assert _total(samples, "tollgate_rejections_total", reason="budget") == 1


async def test_prompt_marker_reaches_no_span_metric_or_log(
    http: AsyncTestClient[Litestar],
    tenant_key: str,
    spans: InMemorySpanExporter,
    log_lines: LogLines,
    engine_client: InProcessEngineClient,
) -> None:
    marker = "zqxmarker" + uuid.uuid4().hex
    model = engine_client.model_name
    streamed = await http.post(
        "/v1/chat/completions",
        json=_chat(model, f"Please repeat {marker} twice", stream=True),
        headers=_auth(tenant_key),
    )
    whole = await http.post(
        "/v1/completions",
        json={"model": model, "prompt": f"{marker} = ", "max_tokens": 4, "echo": True},
        headers={**_auth(tenant_key), "Idempotency-Key": uuid.uuid4().hex},  # stores the body
    )
    assert streamed.status_code == whole.status_code == 200
    assert marker in whole.json()["choices"][0]["text"]  # it was really sent and echoed back
    request_ids = [streamed.headers["x-request-id"], whole.headers["x-request-id"]]
    for request_id in request_ids:
        await _trace_with(spans, request_id, {"settle", "engine.kv_release"})
    scraped = (await http.get("/metrics", headers=_auth(METRICS_TOKEN))).text

    recorded: list[str] = []
    for span in spans.get_finished_spans():
        recorded += [
            span.name,
            str(span.status.description),
            json.dumps(dict(span.resource.attributes)),
        ]
        recorded += [json.dumps(dict(span.attributes or {}), default=str)]
        recorded += [
            e.name + json.dumps(dict(e.attributes or {}), default=str) for e in span.events
        ]
    everything = "\n".join([*recorded, scraped, *log_lines.lines]).splitlines()
    # Always 12 characters: the secret itself may contain "_" (token_urlsafe), and a short
    # tail would turn up by chance in some hex id.
    secret_tail = tenant_key.partition("_")[2][-12:]
    assert len(secret_tail) == 12
    # A failure names the lines that leaked.
    assert [line for line in everything if marker in line] == []
    assert [line for line in everything if tenant_key in line or secret_tail in line] == []
    # What was captured is real: the two requests are logged with their ids.
    logged = [json.loads(line) for line in log_lines.lines]
    finished = [
        e
        for e in logged
        if e["message"] == "request finished" and e.get("request_id") in request_ids
    ]
    assert sorted(e["request_id"] for e in finished) == sorted(request_ids)
    assert [e for e in finished if len(e.get("trace_id", "")) != 32] == []


@pytest.mark.slow
async def test_backend_replica_joins_the_gateway_trace(
    settings: Settings, tenant_key: str, spans: InMemorySpanExporter
) -> None:
    """A backend in its own process exports over OTLP/HTTP to a collector stand-in; its
    spans carry the gateway's trace id, under the gateway's dispatch span."""
    received: list[Any] = []

    @post("/v1/traces", status_code=200)
    async def collect(request: Request[Any, Any, Any]) -> bytes:
        export = ExportTraceServiceRequest()
        export.ParseFromString(await request.body())
        for resource in export.resource_spans:
            for scope in resource.scope_spans:
                received.extend(scope.spans)
        return b""

    secret = secrets.token_hex(16)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    async with serving(Litestar([collect])) as collector:
        backend = start(
            ["backend", "serve", "--port", str(port)],
            {
                "TOLLGATE_BACKEND_SECRET": secret,
                "TOLLGATE_MODEL": "",
                "OTEL_EXPORTER_OTLP_ENDPOINT": collector,
                "OTEL_BSP_SCHEDULE_DELAY": "50",
            },
        )
        with running(backend):
            backend.wait_for("ready on")
            remote = replace(settings, backends=(url,), backend_secret=secret)
            async with AsyncTestClient(app=create_app(remote)) as client:
                model = (await client.get("/v1/models", headers=_auth(tenant_key))).json()
                payload = _chat(model["data"][0]["id"], "Hello", stream=True)
                response = await client.post(
                    "/v1/chat/completions", json=payload, headers=_auth(tenant_key)
                )
                assert response.status_code == 200, response.text
                request_id = response.headers["x-request-id"]
                root, trace_spans = await _trace_with(spans, request_id, {"dispatch", "settle"})
                await eventually(lambda: {"engine.generate", "engine.decode"}
                                 <= {s.name for s in received})  # fmt: skip
            scraped = httpx.get(f"{url}/metrics", headers=_auth(secret)).text
    samples = _metric_samples(scraped)
    assert _total(samples, "tollgate_engine_time_to_first_token_seconds_count") == 1
    assert _total(samples, "tollgate_engine_requests_total", reason="length") == 1
    dispatch = next(s for s in trace_spans if s.name == "dispatch")
    assert root.context is not None and dispatch.context is not None
    served = next(s for s in received if s.name == "engine.generate")
    assert int.from_bytes(served.trace_id, "big") == root.context.trace_id
    assert int.from_bytes(served.parent_span_id, "big") == dispatch.context.span_id
    decode = next(s for s in received if s.name == "engine.decode")
    assert decode.parent_span_id == served.span_id
    tokens = {a.key: a.value.int_value for a in decode.attributes}
    assert tokens["gen_ai.usage.output_tokens"] == 6
    assert (dispatch.attributes or {})["tollgate.replica"] == url
