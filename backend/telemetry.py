"""Engine telemetry, kept out of the step loop.

The engine already stamps every request (arrival, first scheduled, each token), so its
phase spans — queue wait, prefill, decode, KV release — are written after the fact with
those times, once per request. Engine stats become Prometheus metrics at scrape time.
Nothing here sees prompt or completion text: only counts and times.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Mapping

from opentelemetry import context, propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.util.types import AttributeValue
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from backend.outputs import EngineStats, RequestOutput

TRACER_NAME = "tollgate.backend"

# OpenTelemetry GenAI semantic-convention attribute names, and ours.
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
CACHED_INPUT_TOKENS = "gen_ai.usage.cache_read.input_tokens"
FINISH_REASONS = "gen_ai.response.finish_reasons"
REQUEST_ID = "tollgate.request_id"


class RequestTimeline:
    """One request's progress through the engine, from the outputs it yields: a few
    comparisons per output, no allocation. Token timing follows completion 0."""

    __slots__ = (
        "arrival",
        "cached_tokens",
        "completion_tokens",
        "finish_reasons",
        "first_token",
        "last_token",
        "prefill_chunks",
        "prompt_tokens",
        "scheduled",
        "tokens_timed",
    )

    def __init__(self) -> None:
        self.arrival: float | None = None
        self.scheduled: float | None = None
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.prefill_chunks = 0
        self.tokens_timed = 0  # completion 0's tokens, the ones first/last_token time
        self.completion_tokens: dict[int, int] = {}
        self.finish_reasons: list[str] = []

    def observe(self, out: RequestOutput) -> None:
        if self.arrival is None:
            self.arrival = out.arrival_time
        if self.scheduled is None:
            self.scheduled = out.first_scheduled_time
        self.prompt_tokens = out.prompt_tokens
        self.cached_tokens = out.cached_tokens
        self.completion_tokens[out.index] = out.completion_tokens
        if out.index == 0:
            self.prefill_chunks = out.prefill_chunks
        if out.index == 0 and out.token_times:
            if self.first_token is None:
                self.first_token = out.first_token_time or out.token_times[0]
            self.last_token = out.token_times[-1]
            self.tokens_timed = out.completion_tokens
        if out.finished:
            self.finish_reasons.append(out.finish_reason or "unknown")

    @property
    def output_tokens(self) -> int:
        return sum(self.completion_tokens.values())

    @property
    def queue_s(self) -> float | None:
        if self.arrival is None or self.scheduled is None:
            return None
        return self.scheduled - self.arrival

    @property
    def time_per_output_token_s(self) -> float | None:
        """The mean gap between tokens after the first (None below two tokens)."""
        if self.first_token is None or self.last_token is None or self.tokens_timed < 2:
            return None
        return (self.last_token - self.first_token) / (self.tokens_timed - 1)

    def emit_spans(
        self,
        parent: Context,
        ended: float,
        aborted: bool,
        request_id: str,
    ) -> None:
        """Write the engine's phase spans under `parent`; `ended` is time.monotonic() when
        the request left the engine (its KV blocks are freed at that step boundary)."""
        if self.arrival is None or not trace.get_current_span(parent).is_recording():
            return  # never reached the engine, or nobody is tracing
        tracer = trace.get_tracer(TRACER_NAME)
        to_ns = _monotonic_to_epoch_ns()

        def span(
            name: str, start: float, end: float, attributes: Mapping[str, AttributeValue]
        ) -> None:
            attrs = {REQUEST_ID: request_id, **attributes}
            phase = tracer.start_span(name, parent, attributes=attrs, start_time=to_ns(start))
            phase.end(end_time=to_ns(max(start, end)))

        scheduled = self.scheduled
        # Without any output the engine's times are unknown: queued, or queued then prefilling.
        unknown: dict[str, AttributeValue] = (
            {} if self.completion_tokens else {"tollgate.engine.no_output": True}
        )
        span("engine.queue", self.arrival, scheduled if scheduled is not None else ended, unknown)
        if scheduled is not None:
            span(
                "engine.prefill",
                scheduled,
                self.first_token if self.first_token is not None else ended,
                {
                    INPUT_TOKENS: self.prompt_tokens,
                    CACHED_INPUT_TOKENS: self.cached_tokens,
                    "tollgate.prefill.chunks": self.prefill_chunks,
                },
            )
        if self.first_token is not None:
            span(
                "engine.decode",
                self.first_token,
                self.last_token or self.first_token,
                {OUTPUT_TOKENS: self.output_tokens},
            )
        release_from = self.last_token if not aborted and self.last_token is not None else ended
        span(
            "engine.kv_release",
            release_from,
            ended,
            {"tollgate.kv.release_reason": "aborted" if aborted else "finished"},
        )


async def traced(
    outputs: AsyncIterator[RequestOutput],
    request_id: str,
    parent: Context | None = None,
    on_done: Callable[[RequestTimeline, float, bool], None] | None = None,
) -> AsyncGenerator[RequestOutput, None]:
    """Pass a request's outputs through; once it leaves the engine (finished, aborted or
    failed), write its phase spans under `parent` (default: the context current when the
    first output is asked for) and hand its timeline to `on_done`."""
    parent = context.get_current() if parent is None else parent
    timeline = RequestTimeline()
    submitted = time.monotonic()
    finished = refused = False
    try:
        async for out in outputs:
            timeline.observe(out)
            yield out
        finished = True
    except Exception:
        refused = timeline.arrival is None  # turned away (overloaded, invalid): never queued
        raise
    finally:
        close = getattr(outputs, "aclose", None)
        if close is not None:  # abort in the engine now, not when collected
            await close()
        ended = time.monotonic()
        if timeline.arrival is None and not refused:
            # Aborted before its first output, which is what carries the engine's times.
            timeline.arrival = submitted
        timeline.emit_spans(parent, ended, not finished, request_id)
        if on_done is not None:
            on_done(timeline, ended, not finished)


async def served(
    outputs: AsyncIterator[RequestOutput],
    headers: Mapping[str, str],
    request_id: str,
    priority: int,
    metrics: EngineRequestMetrics | None = None,
) -> AsyncGenerator[RequestOutput, None]:
    """A backend's side of one request: a server span joined to the caller's trace (W3C
    traceparent in `headers`), with the engine's phase spans under it; observed once in
    `metrics` when it leaves the engine."""
    span = trace.get_tracer(TRACER_NAME).start_span(
        "engine.generate",
        propagate.extract(headers),
        kind=SpanKind.SERVER,
        attributes={REQUEST_ID: request_id, "tollgate.request.priority": priority},
    )
    parent = trace.set_span_in_context(span)
    try:
        done = None if metrics is None else functools.partial(metrics.observe, priority)
        run = traced(outputs, request_id, parent, done)
        async with contextlib.aclosing(run):
            async for out in run:
                yield out
    except Exception as exc:
        span.record_exception(exc)
        span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
        raise
    finally:
        span.end()


def _monotonic_to_epoch_ns() -> Callable[[float], int]:
    offset = time.time_ns() - time.monotonic_ns()
    return lambda t: int(t * 1e9) + offset


class EngineStatsCollector(Collector):
    """Engine stats as Prometheus metrics, read when scraped (never from the step loop)."""

    def __init__(self, stats: Callable[[], EngineStats | None]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self.stats()
        if stats is None:
            return
        yield _gauge("tollgate_engine_requests_running", "Requests being run", stats.num_running)
        yield _gauge("tollgate_engine_requests_waiting", "Requests queued", stats.num_waiting)
        yield _gauge(
            "tollgate_engine_kv_cache_usage_ratio",
            "Share of KV blocks referenced by requests",
            stats.kv_blocks_used / max(1, stats.kv_blocks_total),
        )
        yield _gauge_by(
            "tollgate_engine_kv_blocks",
            "KV blocks by state",
            "state",
            {
                "used": stats.kv_blocks_used,
                "cached": stats.kv_blocks_cached,
                "free": stats.kv_blocks_free,
            },
        )
        yield _gauge(
            "tollgate_engine_prefix_cache_hit_ratio",
            "Prompt tokens found in the prefix cache, over tokens looked up (since start)",
            stats.prefix_cache_hit_rate,
        )
        counters = (
            (
                "prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache",
                stats.prefix_cache_queries,
            ),
            (
                "prefix_cache_hits",
                "Prompt tokens found in the prefix cache",
                stats.prefix_cache_hits,
            ),
            ("preemptions", "Requests preempted to free KV blocks", stats.num_preemptions),
            ("prefill_tokens", "Prompt tokens computed", stats.total_prefill_tokens),
            ("decode_tokens", "Tokens decoded", stats.total_decode_tokens),
            ("steps", "Engine steps", stats.num_steps),
        )
        for name, help_text, value in counters:
            yield CounterMetricFamily(f"tollgate_engine_{name}", help_text, value=value)
        yield from _step_cost_metrics(stats)
        if stats.speculative_method != "off":
            yield from _spec_decode_metrics(stats)
        if stats.max_lora:
            yield from _lora_metrics(stats)


def _lora_metrics(stats: EngineStats) -> Iterator[Metric]:
    """vLLM's `vllm:lora_requests_info` (the Gateway API Inference Extension's LoRA
    affinity reads it): one series whose labels are the state, valued at the time it was
    read (a reader takes the newest series), adapters comma-separated as vLLM does."""
    info = GaugeMetricFamily(
        "vllm:lora_requests_info",
        "Running stats on lora requests.",
        labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
    )
    running, waiting = ",".join(stats.running_lora_adapters), ",".join(stats.waiting_lora_adapters)
    info.add_metric([str(stats.max_lora), running, waiting], time.time())
    yield info
    yield CounterMetricFamily(
        "tollgate_engine_lora_loads",
        "LoRA adapters read into a device slot",
        value=stats.lora_loads,
    )


def _spec_decode_metrics(stats: EngineStats) -> Iterator[Metric]:
    """Speculative decoding: the counters (vLLM's, under the engine's prefix) and the two
    figures they make."""
    counters = (
        ("num_drafts", "Verified rows that carried draft tokens", stats.spec_decode_num_drafts),
        ("num_draft_tokens", "Draft tokens verified", stats.spec_decode_num_draft_tokens),
        ("num_accepted_tokens", "Draft tokens accepted", stats.spec_decode_num_accepted_tokens),
    )
    for name, help_text, value in counters:
        yield CounterMetricFamily(f"tollgate_engine_spec_decode_{name}", help_text, value=value)
    yield _gauge(
        "tollgate_engine_spec_decode_acceptance_ratio",
        "Accepted draft tokens over draft tokens (since start)",
        stats.spec_decode_acceptance_rate,
    )
    yield _gauge(
        "tollgate_engine_spec_decode_tokens_per_step",
        "Tokens a row with drafts produced per step: 1 + accepted drafts (since start)",
        stats.spec_decode_tokens_per_step,
    )


def _step_cost_metrics(stats: EngineStats) -> Iterator[Metric]:
    """The step-cost fit (backend/engine/step_cost.py): predicted against measured time
    of the last step, the fit's terms, and the budget it set."""
    yield _gauge(
        "tollgate_engine_busy_seconds",
        "Seconds the engine spent stepping since it started (a counter: rate() is the busy share)",
        stats.busy_s,
    )
    yield _gauge(
        "tollgate_engine_batch_busy_seconds",
        "Of the busy seconds, those of batch-class rows (priority >= batch_priority): each "
        "step's time split by its rows' tokens (a counter: over busy_seconds' rate, the "
        "batch share of engine time)",
        stats.batch_busy_s,
    )
    yield _gauge(
        "tollgate_engine_step_time_predicted_seconds",
        "The last step's time as the step-cost fit predicted it",
        stats.step_time_predicted_s,
    )
    yield _gauge(
        "tollgate_engine_step_time_actual_seconds",
        "The last step's time as measured",
        stats.step_time_actual_s,
    )
    yield _gauge(
        "tollgate_engine_step_time_error_ratio",
        "Moving average of |predicted - actual| / actual step time",
        stats.step_time_error_ratio,
    )
    yield _gauge_by(
        "tollgate_engine_step_cost_seconds",
        "Seconds per unit of each fitted term",
        "term",
        stats.step_cost_s,
    )
    yield _gauge(
        "tollgate_engine_step_time_limit_seconds",
        "The time target that sized the last step's budget (0: none, the static budget)",
        stats.step_time_limit_s or 0.0,
    )
    yield _gauge_by(
        "tollgate_engine_step_tokens",
        "Tokens the last step computed, by kind (decode: one per generating request, "
        "plus its drafts under speculative decoding)",
        "kind",
        {"prefill": stats.step_prefill_tokens, "decode": stats.step_decode_tokens},
    )
    yield _gauge(
        "tollgate_engine_step_prefill_budget_tokens",
        "Tokens the last step could spend after its decodes",
        stats.step_prefill_budget,
    )
    yield CounterMetricFamily(
        "tollgate_engine_slot_share_preemptions",
        "Requests preempted so a tenant short of its share of max_num_seqs could start",
        value=stats.num_slot_share_preemptions,
    )
    yield CounterMetricFamily(
        "tollgate_engine_steps_given_way",
        "Steps abandoned between layers so a tenant short of its share could start",
        value=stats.num_steps_given_way,
    )


def _gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, help_text, value=value)


def _gauge_by(
    name: str, help_text: str, label: str, values: Mapping[str, float]
) -> GaugeMetricFamily:
    """One gauge with a sample per value of `label`."""
    family = GaugeMetricFamily(name, help_text, labels=[label])
    for value_of_label, value in values.items():
        family.add_metric([value_of_label], value)
    return family


class ModelServerCollector(Collector):
    """The same engine stats under the names vLLM gives them: the Gateway API Inference
    Extension's model-server protocol, which llm-d's endpoint picker, vLLM
    production-stack's router and KEDA read, so they route and scale Tollgate backends
    unchanged. `num_gpu_blocks` is the KV block count on whatever device holds the cache."""

    def __init__(self, stats: Callable[[], EngineStats | None], model_name: str) -> None:
        self.stats = stats
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self.stats()
        if stats is None:
            return
        usage = stats.kv_blocks_used / max(1, stats.kv_blocks_total)
        gauges = (
            ("num_requests_running", "Number of requests in model execution batches.",
             stats.num_running),
            ("num_requests_waiting", "Number of requests waiting to be processed.",
             stats.num_waiting),
            ("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage),
        )  # fmt: skip
        for name, help_text, value in gauges:
            yield self._family(GaugeMetricFamily, name, help_text, value)
        counters = (
            ("prefix_cache_queries", "Prefix cache queries, in tokens.",
             stats.prefix_cache_queries),
            ("prefix_cache_hits", "Prefix cache hits, in tokens.", stats.prefix_cache_hits),
            ("num_preemptions", "Cumulative number of preemptions.", stats.num_preemptions),
        )  # fmt: skip
        for name, help_text, value in counters:
            yield self._family(CounterMetricFamily, name, help_text, value)
        if stats.speculative_method != "off":
            yield from self._spec_decode(stats)
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=["block_size", "num_gpu_blocks"],
        )
        info.add_metric([str(stats.block_size), str(stats.kv_blocks_total)], 1.0)
        yield info

    def _spec_decode(self, stats: EngineStats) -> Iterator[Metric]:
        """vLLM's speculative decoding counters (vllm:spec_decode_*_total)."""
        counters = (
            ("spec_decode_num_drafts", "Number of spec decoding drafts.",
             stats.spec_decode_num_drafts),
            ("spec_decode_num_draft_tokens", "Number of draft tokens.",
             stats.spec_decode_num_draft_tokens),
            ("spec_decode_num_accepted_tokens", "Number of accepted tokens.",
             stats.spec_decode_num_accepted_tokens),
        )  # fmt: skip
        for name, help_text, value in counters:
            yield self._family(CounterMetricFamily, name, help_text, value)
        per_pos = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            labels=["model_name", "position"],
        )
        for position, value in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
            per_pos.add_metric([self.model_name, str(position)], value)
        yield per_pos

    def _family(
        self,
        kind: type[GaugeMetricFamily] | type[CounterMetricFamily],
        name: str,
        help_text: str,
        value: float,
    ) -> Metric:
        family = kind(f"vllm:{name}", help_text, labels=["model_name"])
        family.add_metric([self.model_name], value)
        return family


# Engine-side latency: the replica's own view, without gateway or network time.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class EngineRequestMetrics:
    """Per-request histograms of one backend replica, by priority; one observation per
    request, when it leaves the engine."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def histogram(name: str, help_text: str) -> Histogram:
            return Histogram(
                name, help_text, ["priority"], registry=registry, buckets=LATENCY_BUCKETS
            )

        self.queue = histogram(
            "tollgate_engine_queue_time_seconds", "Arrival in the engine to first scheduled"
        )
        self.ttft = histogram(
            "tollgate_engine_time_to_first_token_seconds", "Arrival in the engine to first token"
        )
        self.tpot = histogram(
            "tollgate_engine_time_per_output_token_seconds",
            "Mean gap between tokens after the first, per request",
        )
        self.duration = histogram(
            "tollgate_engine_request_duration_seconds", "Arrival in the engine to leaving it"
        )
        self.finished = Counter(
            "tollgate_engine_requests",
            "Requests that left the engine",
            ["reason"],
            registry=registry,
        )

    def observe(
        self, priority: int, timeline: RequestTimeline, ended: float, aborted: bool
    ) -> None:
        if timeline.arrival is None:
            return  # refused before it reached the engine
        label = str(priority)
        self.duration.labels(label).observe(ended - timeline.arrival)
        if timeline.queue_s is not None:
            self.queue.labels(label).observe(timeline.queue_s)
        if timeline.first_token is not None:
            self.ttft.labels(label).observe(timeline.first_token - timeline.arrival)
        if timeline.time_per_output_token_s is not None:
            self.tpot.labels(label).observe(timeline.time_per_output_token_s)
        reason = "abort" if aborted else (timeline.finish_reasons or ["unknown"])[0]
        self.finished.labels(reason).inc()
