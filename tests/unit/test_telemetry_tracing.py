"""Tracing set-up from OTEL_* variables, and the engine's phase spans written after the fact."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

from backend.outputs import RequestOutput
from backend.telemetry import RequestTimeline, traced
from gateway.telemetry.request import RequestScope, Telemetry
from gateway.telemetry.tracing import build_tracer_provider, exporting, in_span


class _Capture(SimpleSpanProcessor):
    """Keeps ended spans only while a test is capturing, so the rest of the suite, which
    runs under the same global provider, does not pile spans up in memory."""

    active = False

    def on_end(self, span: ReadableSpan) -> None:
        if self.active:
            super().on_end(span)


_EXPORTER = InMemorySpanExporter()
_CAPTURE = _Capture(_EXPORTER)


@contextlib.contextmanager
def capture_spans() -> Iterator[InMemorySpanExporter]:
    """Spans ended while the block runs, in memory. The global SDK provider is installed
    on first use (it can be set only once per process)."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    if not getattr(provider, "_tollgate_capture", False):
        provider.add_span_processor(_CAPTURE)
        provider._tollgate_capture = True  # type: ignore[attr-defined]
    _EXPORTER.clear()
    _CAPTURE.active = True
    try:
        yield _EXPORTER
    finally:
        _CAPTURE.active = False
        _EXPORTER.clear()


def test_no_endpoint_means_no_exporter() -> None:
    assert not exporting({})
    assert build_tracer_provider("svc", {}) is None
    assert not exporting({"OTEL_EXPORTER_OTLP_ENDPOINT": "  "})


def test_endpoint_turns_export_on_unless_disabled() -> None:
    assert exporting({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"})
    assert exporting({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"})
    on = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}
    assert not exporting({**on, "OTEL_SDK_DISABLED": "true"})
    assert not exporting({**on, "OTEL_TRACES_EXPORTER": "none"})


def test_provider_names_the_service() -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}
    provider = build_tracer_provider("tollgate-gateway", env)
    assert provider is not None
    try:
        assert provider.resource.attributes["service.name"] == "tollgate-gateway"
    finally:
        provider.shutdown()
    named = build_tracer_provider("tollgate-gateway", {**env, "OTEL_SERVICE_NAME": "edge-1"})
    assert named is not None
    try:
        assert named.resource.attributes["service.name"] == "edge-1"
    finally:
        named.shutdown()


def _output(index: int, tokens: int, times: list[float], finished: bool) -> RequestOutput:
    return RequestOutput(
        request_id="req_t",
        text="",
        token_ids=[7] * len(times),
        finished=finished,
        finish_reason="length" if finished else None,
        prompt_tokens=40,
        completion_tokens=tokens,
        cached_tokens=16,
        prefill_chunks=3,
        arrival_time=100.0,
        first_scheduled_time=100.5,
        first_token_time=101.0,
        token_times=times,
        index=index,
    )


def test_timeline_measures_queue_and_time_per_token() -> None:
    timeline = RequestTimeline()
    timeline.observe(_output(0, 1, [101.0], finished=False))
    assert timeline.time_per_output_token_s is None  # one token: no gap yet
    timeline.observe(_output(0, 3, [101.2, 101.4], finished=True))
    assert timeline.queue_s == 0.5
    assert abs((timeline.time_per_output_token_s or 0) - 0.2) < 1e-9
    assert timeline.output_tokens == 3
    assert timeline.finish_reasons == ["length"]


def _by_name(spans: tuple[ReadableSpan, ...]) -> dict[str, ReadableSpan]:
    return {span.name: span for span in spans}


def test_engine_phase_spans_use_the_engine_times() -> None:
    with capture_spans() as exporter:
        _write_phase_spans()
        spans = _by_name(exporter.get_finished_spans())
    queue, prefill, decode = spans["engine.queue"], spans["engine.prefill"], spans["engine.decode"]
    assert queue.end_time is not None and queue.start_time is not None
    assert abs((queue.end_time - queue.start_time) - 500_000_000) < 1000
    assert prefill.start_time == queue.end_time
    assert prefill.attributes is not None and decode.attributes is not None
    assert prefill.attributes["gen_ai.usage.cache_read.input_tokens"] == 16
    assert prefill.attributes["tollgate.prefill.chunks"] == 3
    assert decode.attributes["gen_ai.usage.output_tokens"] == 2
    release = spans["engine.kv_release"]
    assert release.attributes is not None
    assert release.attributes["tollgate.kv.release_reason"] == "finished"
    assert {spans[n].parent.span_id for n in spans if n != "parent"} == {  # type: ignore[union-attr]
        spans["parent"].context.span_id  # type: ignore[union-attr]
    }


def _write_phase_spans() -> None:
    tracer = trace.get_tracer("test")
    timeline = RequestTimeline()
    timeline.observe(_output(0, 2, [101.0, 101.25], finished=True))
    with tracer.start_as_current_span("parent") as parent:
        timeline.emit_spans(trace.set_span_in_context(parent), 101.3, False, request_id="req_t")


def test_no_spans_when_nobody_traces() -> None:
    with capture_spans() as exporter:
        timeline = RequestTimeline()
        timeline.observe(_output(0, 1, [101.0], finished=True))
        nobody = trace.set_span_in_context(trace.INVALID_SPAN)
        timeline.emit_spans(nobody, 101.1, False, "req_t")
        assert exporter.get_finished_spans() == ()


async def _never_outputs(waiting: asyncio.Event) -> AsyncIterator[RequestOutput]:
    waiting.set()
    await asyncio.Event().wait()  # queued forever: the consumer gives up first
    yield _output(0, 1, [101.0], finished=True)


async def _refuses() -> AsyncIterator[RequestOutput]:
    raise ValueError("overloaded")
    yield _output(0, 1, [101.0], finished=True)  # an async generator all the same


async def test_aborted_before_any_output_still_shows_wait_and_release() -> None:
    with capture_spans() as exporter:
        with trace.get_tracer("test").start_as_current_span("parent"):
            queued = asyncio.Event()
            waiting = asyncio.ensure_future(anext(traced(_never_outputs(queued), "req_q")))
            await queued.wait()
            waiting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await waiting
        spans = _by_name(exporter.get_finished_spans())
    assert (spans["engine.queue"].attributes or {})["tollgate.engine.no_output"] is True
    release = spans["engine.kv_release"].attributes or {}
    assert release["tollgate.kv.release_reason"] == "aborted"
    assert "engine.prefill" not in spans


async def test_refused_requests_have_no_engine_spans() -> None:
    with capture_spans() as exporter:
        with (
            trace.get_tracer("test").start_as_current_span("parent"),
            contextlib.suppress(ValueError),
        ):
            await anext(traced(_refuses(), "req_r"))
        assert [s.name for s in exporter.get_finished_spans()] == ["parent"]


async def _current_span_id() -> int:
    return trace.get_current_span().get_span_context().span_id


async def test_phases_under_a_sampled_out_root_make_no_spans() -> None:
    """Nothing exported (the root sampled out): the phases stand in with the root's
    context, so the trace id still goes on, and no span is made for them."""
    root = TracerProvider(sampler=ALWAYS_OFF).get_tracer("t").start_span("root")
    scope = RequestScope(Telemetry(), root)
    assert not scope.sampled
    with scope.span("admission") as phase:
        assert phase.get_span_context() == root.get_span_context()
    streaming = scope.start_span("stream")
    assert streaming.get_span_context() == root.get_span_context()
    streaming.end()
    with trace.use_span(root):
        assert await in_span("settle", _current_span_id()) == root.get_span_context().span_id
