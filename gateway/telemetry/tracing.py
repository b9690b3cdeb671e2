"""Tracing set-up from the standard OTEL_* variables, and the span names and attributes
the gateway writes.

With no OTLP endpoint set (or OTEL_TRACES_EXPORTER=none) nothing is exported and spans
are sampled out: non-recording, next to free, but with trace ids for the logs and the
backends. OTEL_SDK_DISABLED=true leaves OpenTelemetry's no-op API in place. Everything else
(headers, timeouts, protocol details, sampler, resource attributes) is read by the SDK
and the OTLP exporter from their own OTEL_* variables.

Not in Settings, on purpose: every variable read here is a standard OTEL_* one that the
SDK and the exporter read themselves too (Tollgate has no tracing variable of its own),
and the tracer provider is process-wide, so `tollgate serve` installs it once, outside
create_app.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Awaitable, Mapping
from typing import TypeVar

from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.util.types import AttributeValue

# Re-exported: the gateway and the backend write one set of names.
from backend.telemetry import CACHED_INPUT_TOKENS as CACHED_INPUT_TOKENS
from backend.telemetry import FINISH_REASONS as FINISH_REASONS
from backend.telemetry import INPUT_TOKENS as INPUT_TOKENS
from backend.telemetry import OUTPUT_TOKENS as OUTPUT_TOKENS
from backend.telemetry import REQUEST_ID as REQUEST_ID

T = TypeVar("T")

TRACER_NAME = "tollgate.gateway"

# OpenTelemetry GenAI semantic conventions (Development status), and ours.
OPERATION = "gen_ai.operation.name"
PROVIDER = "gen_ai.provider.name"
REQUEST_MODEL = "gen_ai.request.model"
REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
REQUEST_STREAM = "gen_ai.request.stream"
RESPONSE_ID = "gen_ai.response.id"
RESPONSE_MODEL = "gen_ai.response.model"
ERROR_TYPE = "error.type"
TENANT = "tollgate.tenant.id"
PRIORITY = "tollgate.request.priority"
WORKLOAD_CLASS = "tollgate.workload_class"
REPLICA = "tollgate.replica"
PROVIDER_NAME = "tollgate"

TRACE_ENDPOINTS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


@functools.cache
def tracer() -> trace.Tracer:
    """The gateway's tracer, made once: the SDK's get_tracer costs more than the spans it
    makes (a warnings filter is set up on every call), and requests ask for it several
    times each. Made before a provider is installed, it is the API's proxy tracer, which
    uses the provider from then on."""
    return trace.get_tracer(TRACER_NAME)


def exporting(env: Mapping[str, str]) -> bool:
    """Whether the OTEL_* variables ask for traces to be exported over OTLP."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return False
    return any(env.get(name, "").strip() for name in TRACE_ENDPOINTS)


def build_tracer_provider(
    default_service: str, env: Mapping[str, str] | None = None
) -> TracerProvider | None:
    """An SDK provider batching spans to the OTLP/HTTP exporter, or None when not exporting."""
    env = os.environ if env is None else env
    if not exporting(env):
        return None
    # Imported here: the exporter pulls in protobuf, which a no-telemetry install never needs.
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    service = env.get("OTEL_SERVICE_NAME", "").strip() or default_service
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider


def setup_tracing(default_service: str, env: Mapping[str, str] | None = None) -> TracerProvider:
    """Install the provider the environment asks for (once per process, at start-up).
    Without an exporter, spans are sampled out: nothing is recorded, but every request
    still gets a trace id (for log lines, and passed on to the backends)."""
    env = os.environ if env is None else env
    provider = build_tracer_provider(default_service, env) or TracerProvider(sampler=ALWAYS_OFF)
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() != "true":
        trace.set_tracer_provider(provider)
    return provider


def trace_headers() -> dict[str, str]:
    """W3C traceparent (and baggage) of the current span, for a call to a backend."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier


def note_replica(url: str) -> None:
    """The dispatch span records each replica tried, in order (retries show as events)."""
    span = trace.get_current_span()
    span.set_attribute(REPLICA, url)
    span.add_event("routed", {REPLICA: url})


async def in_span(name: str, work: Awaitable[T], **attributes: AttributeValue) -> T:
    """Await `work` under a span: for work spawned as its own task (settlement). Under a
    request's span that is sampled out, none is made: a child of it would not be recorded
    either (the SDK's default sampler follows the parent)."""
    parent = trace.get_current_span().get_span_context()
    if parent.is_valid and not parent.trace_flags.sampled:
        return await work
    with tracer().start_as_current_span(name, attributes=attributes):
        return await work
