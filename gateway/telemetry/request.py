"""One request's telemetry: its root span, the phase spans under it, one metrics
observation when it settles and one log line when it ends.

An ASGI middleware (gateway/http/telemetry.py) opens a `RequestScope` for every /v1
request and keeps it in a context variable, so admission, dispatch and generation reach
it with `current_request()` without threading it through every signature. Outside a request
(unit tests, background tasks) that returns an inert scope that keeps nothing.

Every HTTP request, /v1 or not (the admin API, the console, probes), gets one "request
finished" line with what an access log line carries (method, path, status, duration,
client address), so `tollgate serve` runs uvicorn without its access log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from opentelemetry import context, propagate, trace
from opentelemetry.trace import (
    INVALID_SPAN,
    NonRecordingSpan,
    Span,
    SpanKind,
    Status,
    StatusCode,
)

from backend.outputs import RequestOutput
from backend.telemetry import RequestTimeline
from gateway.telemetry import tracing
from gateway.telemetry.logs import client_request_id_var, request_id_var
from gateway.telemetry.metrics import GatewayMetrics, RequestObservation

if TYPE_CHECKING:
    from gateway.core.usage import Metered, RequestUsage
    from gateway.settings import Settings
    from tenants.services import Principal

log = logging.getLogger("tollgate.requests")

DOCUMENT_PROMPT_TOKENS = 1024  # a prompt this long is a document, whatever the endpoint
# Admitted, then refused by the engine's scheduling policy before any token: rejections too.
ENGINE_REFUSALS = ("overloaded", "deadline_exceeded")
WORKLOAD_CLASSES = {"chat.completions": "chat", "responses": "chat", "embeddings": "embedding"}
OPERATIONS = {
    "chat.completions": "chat",
    "responses": "chat",
    "completions": "text_completion",
    "embeddings": "embeddings",
}
# Why a request was turned away, when nothing more specific was noted.
STATUS_REASONS = {
    400: "invalid_request",
    401: "authentication",
    403: "permission",
    404: "not_found",
    409: "conflict",
    413: "body_too_large",
    422: "idempotency_mismatch",
    429: "rate_limited",
    499: "client_closed",
    500: "internal",
    503: "unavailable",
    504: "deadline",
}


CLIENT_REQUEST_ID = "tollgate.client_request_id"
_PRINTABLE = re.compile(r"[\x20-\x7e]{1,128}")


def client_request_id(headers: Mapping[str, str]) -> str | None:
    """The caller's x-request-id if it is well formed (at most 128 printable ASCII
    characters): kept and echoed. Anything else is ignored, and the gateway's id sent."""
    given = headers.get("x-request-id", "")
    return given if _PRINTABLE.fullmatch(given) else None


def workload_class(endpoint: str, prompt_tokens: int) -> str:
    """`document` for long prompts (prefill-bound), else `chat`, `embedding` or
    `completion` by endpoint."""
    if prompt_tokens >= DOCUMENT_PROMPT_TOKENS:
        return "document"
    return WORKLOAD_CLASSES.get(endpoint, "completion")


@dataclass
class Telemetry:
    """What the app holds: the metrics registry, who may scrape it, and the plan budgets
    of the tenants seen lately (for the budget gauges)."""

    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    metrics_token: str | None = None
    budgets: dict[str, int | None] = field(default_factory=dict)

    @classmethod
    def from_settings(cls, settings: Settings) -> Telemetry:
        """TOLLGATE_METRICS_TOKEN guards /metrics; TOLLGATE_METRICS_TOP_TENANTS bounds the
        tenant label."""
        metrics = GatewayMetrics(top_tenants=settings.metrics_top_tenants)
        return cls(metrics, metrics_token=settings.metrics_token)

    def note_budget(self, tenant: str, budget_micros: int | None) -> None:
        self.budgets[tenant] = budget_micros
        if len(self.budgets) > 4 * self.metrics.tenants.top_n:  # keep the labelled ones
            labelled = self.metrics.tenants.labelled
            self.budgets = {t: b for t, b in self.budgets.items() if t in labelled}


@contextlib.contextmanager
def opened(
    telemetry: Telemetry, method: str, path: str, headers: dict[str, str], access: dict[str, Any]
) -> Iterator[RequestScope]:
    """One /v1 request's scope (gateway/http/telemetry.py opens it around the app): its
    span, joined to the caller's trace, and its context, reachable by `current_request()`
    until it closes."""
    span = tracing.tracer().start_span(
        f"{method} {path}",
        propagate.extract(headers),  # join the caller's trace, if it sent a traceparent
        kind=SpanKind.SERVER,
        attributes={"http.request.method": method, "url.path": path},
    )
    request = RequestScope(telemetry, span, access=access)
    given = client_request_id(headers)
    if given is not None:
        span.set_attribute(CLIENT_REQUEST_ID, given)
    tokens = (
        context.attach(trace.set_span_in_context(span)),
        _current.set(request),
        request_id_var.set(None),
        client_request_id_var.set(given),
    )
    try:
        yield request
    except BaseException as exc:
        span.record_exception(exc)
        raise
    finally:
        request.close()
        client_request_id_var.reset(tokens[3])
        request_id_var.reset(tokens[2])
        _current.reset(tokens[1])
        context.detach(tokens[0])


@dataclass
class RequestScope:
    telemetry: Telemetry | None
    root: Span
    access: dict[str, Any] = field(default_factory=dict)  # method, path, client address
    status: int = 500
    request_id: str | None = None
    tenant: str | None = None
    model: str | None = None
    admitted: bool = False
    rejection: str | None = None  # the specific reason, when admission noted one
    outcome: str | None = None  # completed | cancelled | failed, once settled
    started: float = field(default_factory=time.monotonic)
    timeline: RequestTimeline = field(default_factory=RequestTimeline)
    replica: str | None = None  # where dispatch sent it last
    held: asyncio.Future[None] | None = None  # the answer starts once it is done

    def answer_after(self, written: asyncio.Future[None]) -> bool:
        """Start the answer only once `written` (its usage row on disk) is done: the answer
        is encoded meanwhile. False outside a request this middleware serves (nothing
        would wait): the caller waits then."""
        if self.telemetry is None:
            return False
        self.held = written
        return True

    def take_hold(self) -> asyncio.Future[None] | None:
        """What the answer must wait for, once: after it, an error answer goes out freely."""
        held, self.held = self.held, None
        return held

    @property
    def sampled(self) -> bool:
        return bool(self.root.get_span_context().trace_flags.sampled)

    @property
    def trace_id(self) -> str | None:
        context = self.root.get_span_context()
        return format(context.trace_id, "032x") if context.is_valid else None

    def route(self, replica: str) -> None:
        """Dispatch sent the request to `replica` (again, on a retry)."""
        tracing.note_replica(replica)
        self.replica = replica

    def identify(self, principal: Principal) -> None:
        """Who is calling (after authentication): tenant only, never the key."""
        self.tenant = principal.tenant_id
        self.root.set_attribute(tracing.TENANT, principal.tenant_id)
        if self.telemetry is not None:
            self.telemetry.metrics.name_tenant(principal.tenant_id, principal.tenant_name)
            self.telemetry.note_budget(
                principal.tenant_id, principal.plan.limits.monthly_budget_micros
            )

    def assign_id(self, request_id: str) -> None:
        """The id of a request that did not get one from describe() (not a generation),
        given when it is answered: its span and its log line carry it too."""
        if self.telemetry is None or self.request_id:
            return
        self.request_id = request_id
        request_id_var.set(request_id)
        self.root.set_attribute(tracing.REQUEST_ID, request_id)

    def describe(self, job: Metered, stream: bool) -> None:
        """Name the root span after the operation, with the GenAI request attributes."""
        self.request_id = job.charge.request_id
        self.model = job.charge.model
        request_id_var.set(self.request_id)
        operation = OPERATIONS.get(job.charge.endpoint, job.charge.endpoint)
        self.root.update_name(f"{operation} {job.charge.model}")
        self.root.set_attributes(
            {
                tracing.OPERATION: operation,
                tracing.PROVIDER: tracing.PROVIDER_NAME,
                tracing.REQUEST_MODEL: job.charge.model,
                tracing.REQUEST_MAX_TOKENS: job.params.max_tokens,
                tracing.REQUEST_STREAM: stream,
                tracing.RESPONSE_ID: job.response_id,
                tracing.REQUEST_ID: job.charge.request_id,
                tracing.PRIORITY: job.charge.priority,
                tracing.WORKLOAD_CLASS: workload_class(job.charge.endpoint, len(job.prompt)),
            }
        )

    @contextlib.contextmanager
    def span(self, name: str, **attributes: Any) -> Iterator[Span]:
        """A phase of this request, current while the block runs (never across a yield).
        Under a root that is sampled out (nothing exported), none is made: a stand-in
        with the root's context (its trace id goes on, what is set on it is dropped), as
        a child of it would not be recorded either (the SDK's default sampler follows
        the parent)."""
        if self.telemetry is None:
            yield INVALID_SPAN
            return
        if not self.sampled:
            yield NonRecordingSpan(self.root.get_span_context())
            return
        with tracing.tracer().start_as_current_span(name, attributes=attributes) as phase:
            yield phase

    def start_span(self, name: str, **attributes: Any) -> Span:
        """A phase that spans yields (a stream): not made current; the caller ends it.
        Under a root that is sampled out, a stand-in with the root's context."""
        if self.telemetry is None:
            return INVALID_SPAN
        if not self.sampled:
            return NonRecordingSpan(self.root.get_span_context())
        parent = trace.set_span_in_context(self.root)
        return tracing.tracer().start_span(name, parent, attributes=attributes)

    async def dispatch(self, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        """Pass the engine's outputs through under a `dispatch` span, which is current while
        the request goes out (routing, the backend call) and ends with the engine stream.
        Per output: one timeline update, nothing else."""
        span = self.start_span("dispatch")
        # The inert scope's timeline is shared: it is never written, this one is dropped.
        timeline = self.timeline if self.telemetry is not None else RequestTimeline()
        try:
            with trace.use_span(span, record_exception=False, set_status_on_exception=False):
                out = await anext(outputs, None)
            while out is not None:
                timeline.observe(out)
                yield out
                out = await anext(outputs, None)
        except Exception as exc:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            raise
        finally:
            span.set_attribute(tracing.OUTPUT_TOKENS, timeline.output_tokens)
            span.end()
            close = getattr(outputs, "aclose", None)
            if close is not None:  # abort in the engine now, not when collected
                await close()

    def reject(self, reason: str) -> None:
        self.rejection = reason

    def finish(self, job: Metered, outcome: RequestUsage) -> None:
        """The request settles: usage on the root span, one observation in the metrics;
        the outcome learns the trace and the replica, for the ledger."""
        outcome.trace_id, outcome.replica = self.trace_id, self.replica
        if self.telemetry is None:
            return
        timeline = self.timeline
        self.outcome = str(outcome.status)
        reasons = timeline.finish_reasons or [outcome.finish_reason or str(outcome.status)]
        self.root.set_attributes(
            {
                tracing.RESPONSE_MODEL: job.charge.model,
                tracing.INPUT_TOKENS: outcome.prompt_tokens,
                tracing.OUTPUT_TOKENS: outcome.completion_tokens,
                tracing.CACHED_INPUT_TOKENS: outcome.cached_tokens,
                tracing.FINISH_REASONS: reasons,
                "tollgate.outcome": self.outcome,
            }
        )
        if outcome.error is not None:
            self.root.set_attribute(tracing.ERROR_TYPE, outcome.error)
            self.root.set_status(Status(StatusCode.ERROR, outcome.error))
            if outcome.error in ENGINE_REFUSALS and outcome.completion_tokens == 0:
                self.telemetry.metrics.reject(job.charge.principal.tenant_id, outcome.error)
        self.telemetry.metrics.observe(
            RequestObservation(
                tenant=job.charge.principal.tenant_id,
                model=job.charge.model,
                status=self.outcome,
                workload_class=workload_class(job.charge.endpoint, len(job.prompt)),
                priority=job.charge.priority,
                input_tokens=outcome.prompt_tokens,
                cached_tokens=outcome.cached_tokens,
                output_tokens=outcome.completion_tokens,
                duration_s=(outcome.e2e_ms or 0.0) / 1000,
                queue_s=timeline.queue_s,
                ttft_s=None if outcome.ttft_ms is None else outcome.ttft_ms / 1000,
                time_per_output_token_s=timeline.time_per_output_token_s,
            )
        )

    def close(self) -> None:
        """The response is out: count a rejection, log one line, end the root span."""
        if self.telemetry is None:
            return
        self.root.set_attribute("http.response.status_code", self.status)
        rejected = not self.admitted and self.status >= 400
        if rejected:
            reason = self.rejection or STATUS_REASONS.get(self.status, str(self.status))
            self.telemetry.metrics.reject(self.tenant, reason)
            self.root.set_attribute(tracing.ERROR_TYPE, reason)
        if self.status >= 500:
            self.root.set_status(Status(StatusCode.ERROR))
        log.info(
            "request finished",
            extra={
                **self.access,
                "http_status": self.status,
                "tenant_id": self.tenant,
                "model": self.model,
                "outcome": self.outcome or ("rejected" if rejected else None),
                "duration_ms": round((time.monotonic() - self.started) * 1000, 3),
            },
        )
        self.root.end()


class _InertScope(RequestScope):
    """The scope outside any request (unit tests, background tasks, routes outside /v1),
    one object shared by all of them: every write after construction is dropped, so
    nothing one caller notes (a tenant, a request id, a rejection) reaches another."""

    def __setattr__(self, name: str, value: object) -> None:
        if name not in self.__dict__:  # the dataclass's __init__ sets each field once
            object.__setattr__(self, name, value)


_INERT = _InertScope(None, INVALID_SPAN)
_current: ContextVar[RequestScope] = ContextVar("tollgate_request_scope", default=_INERT)


def current_request() -> RequestScope:
    return _current.get()
