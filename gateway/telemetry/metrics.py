"""Prometheus metrics of the gateway, with the tenant label bounded.

Histogram names follow the OpenTelemetry GenAI conventions in Prometheus form
(`gen_ai.server.time_to_first_token` -> `gen_ai_server_time_to_first_token_seconds`).
Every request is observed once, when it settles — never per token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from backend.outputs import EngineStats
from backend.telemetry import EngineStatsCollector

OTHER = "other"  # the tenant label of everyone outside the top N
NO_TENANT = "none"  # rejected before the key was known

# Buckets of the GenAI conventions, with finer steps below 10 ms for small models.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1,
    2.5,
    5,
    7.5,
    10,
)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1, 2.5)  # fmt: skip
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48,
                    40.96, 81.92)  # fmt: skip
DISAGREEMENT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
QUEUE_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


@dataclass
class TenantLabels:
    """Who gets a label of their own: at most `top_n` tenants, the busiest seen so far;
    everyone else is `other`. A newcomer takes the place of the quietest labelled tenant
    once it has seen twice that tenant's traffic; the series of the one displaced are
    dropped (`on_evict`), so the number of series stays bounded, not just slow-growing.
    Counts are kept for at most `4 * top_n` tenants (the least counted are forgotten)."""

    top_n: int = 20
    on_evict: Callable[[str], None] = lambda tenant: None
    counts: dict[str, int] = field(default_factory=dict)
    labelled: set[str] = field(default_factory=set)

    def label(self, tenant: str) -> str:
        self._count(tenant)
        if tenant in self.labelled:
            return tenant
        if len(self.labelled) < self.top_n:
            self.labelled.add(tenant)
            return tenant
        quietest = min(self.labelled, key=lambda t: self.counts.get(t, 0))
        if self.counts[tenant] >= 2 * max(1, self.counts.get(quietest, 0)):
            self.labelled.discard(quietest)
            self.labelled.add(tenant)
            self.on_evict(quietest)
            return tenant
        return OTHER

    def _count(self, tenant: str) -> None:
        if tenant not in self.counts and len(self.counts) >= 4 * self.top_n:
            # Space-saving: forget the least counted unlabelled tenant, lend its count.
            candidates = [t for t in self.counts if t not in self.labelled]
            forgotten = min(candidates, key=self.counts.__getitem__)
            self.counts[tenant] = self.counts.pop(forgotten)
        self.counts[tenant] = self.counts.get(tenant, 0) + 1


@dataclass(frozen=True)
class RequestObservation:
    """What one settled request contributes to the metrics."""

    tenant: str
    model: str
    status: str  # completed | cancelled | failed
    workload_class: str
    priority: int
    input_tokens: int
    cached_tokens: int
    output_tokens: int
    duration_s: float
    queue_s: float | None
    ttft_s: float | None
    time_per_output_token_s: float | None


class GatewayMetrics:
    def __init__(self, top_tenants: int = 20) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._series: dict[str, set[tuple[Counter | Gauge, tuple[str, ...]]]] = {}
        self._names: dict[str, str] = {}  # tenant id -> name, the label it is shown by
        self.tenants = TenantLabels(top_tenants, on_evict=self._drop_tenant)
        self._add_counters(self.registry)
        self._add_latencies(self.registry)
        self._add_tenant_gauges(self.registry)

    def _add_counters(self, reg: CollectorRegistry) -> None:
        self.requests = Counter(
            "tollgate_requests", "Requests admitted, by outcome",
            ["tenant", "model", "status"], registry=reg,
        )  # fmt: skip
        self.tokens = Counter(
            "tollgate_tokens", "Tokens by type (input, cached_input, output)",
            ["tenant", "model", "type"], registry=reg,
        )  # fmt: skip
        self.rejections = Counter(
            "tollgate_rejections", "Requests turned away, by reason",
            ["tenant", "reason"], registry=reg,
        )  # fmt: skip
        self.usage_disagreement = Histogram(
            "tollgate_upstream_usage_disagreement_tokens",
            "Tokens by which an upstream's usage differs from the gateway's own count (the "
            "ledger takes the upstream's); only requests where they differ",
            ["model", "kind", "direction"], registry=reg, buckets=DISAGREEMENT_BUCKETS,
        )  # fmt: skip
        self.usage_capped = Counter(
            "tollgate_upstream_usage_capped", "Upstream answers whose usage exceeded what was "
            "reserved (billed the reservation): the upstream is suspect",
            ["model", "upstream", "kind"], registry=reg,
        )  # fmt: skip
        self.usage_capped_tokens = Counter(
            "tollgate_upstream_usage_capped_tokens", "Tokens an upstream claimed beyond what "
            "was reserved, not billed", ["model", "upstream", "kind"], registry=reg,
        )  # fmt: skip

    def _add_latencies(self, reg: CollectorRegistry) -> None:
        def per_class(name: str, documentation: str, buckets: Sequence[float]) -> Histogram:
            """A latency histogram by model, workload class and priority."""
            labels = ["model", "workload_class", "priority"]
            return Histogram(name, documentation, labels, registry=reg, buckets=buckets)

        self.ttft = per_class(
            "gen_ai_server_time_to_first_token_seconds",
            "Time from the request's arrival at the gateway to its first token",
            TTFT_BUCKETS,
        )
        self.tpot = per_class(
            "gen_ai_server_time_per_output_token_seconds",
            "Mean time between output tokens after the first (one observation per request)",
            TPOT_BUCKETS,
        )
        self.duration = per_class(
            "gen_ai_server_request_duration_seconds",
            "End-to-end time of an admitted request at the gateway",
            DURATION_BUCKETS,
        )
        self.queue = per_class(
            "tollgate_queue_time_seconds",
            "Time waiting in the engine before first scheduled",
            QUEUE_BUCKETS,
        )

    def _add_tenant_gauges(self, reg: CollectorRegistry) -> None:
        def per_tenant(name: str, documentation: str) -> Gauge:
            return Gauge(name, documentation, ["tenant"], registry=reg)

        self.reserved_micros = per_tenant(
            "tollgate_tenant_reserved_micros", "Cost held by live reservations (micro-units)"
        )
        self.concurrent = per_tenant(
            "tollgate_tenant_concurrent_requests", "Live reservations of the tenant"
        )
        self.budget_spent = per_tenant(
            "tollgate_tenant_budget_spent_micros", "Spent this budget period (micro-units)"
        )
        self.budget_limit = per_tenant(
            "tollgate_tenant_budget_limit_micros", "Monthly budget of the tenant's plan"
        )

    def watch_engine(self, stats: Callable[[], EngineStats | None]) -> None:
        """Export an in-process engine's stats too (embedded mode)."""
        self.registry.register(EngineStatsCollector(stats))

    def name_tenant(self, tenant_id: str, name: str) -> None:
        """Label `tenant_id`'s series with its name (names of the counted tenants only)."""
        self._names[tenant_id] = name
        if len(self._names) > 4 * self.tenants.top_n:
            counted = self.tenants.counts.keys() | self.tenants.labelled | {tenant_id}
            self._names = {t: n for t, n in self._names.items() if t in counted}

    def tenant(self, tenant_id: str) -> str:
        label = self.tenants.label(tenant_id)
        return OTHER if label == OTHER else self._names.get(tenant_id, tenant_id)

    def observe(self, record: RequestObservation) -> None:
        tenant = self.tenant(record.tenant)
        self._inc(self.requests, record.tenant, (tenant, record.model, record.status))
        for kind, count in (
            ("input", record.input_tokens),
            ("cached_input", record.cached_tokens),
            ("output", record.output_tokens),
        ):
            self._inc(self.tokens, record.tenant, (tenant, record.model, kind), count)
        labels = (record.model, record.workload_class, str(record.priority))
        self.duration.labels(*labels).observe(record.duration_s)
        if record.queue_s is not None:
            self.queue.labels(*labels).observe(record.queue_s)
        if record.ttft_s is not None:
            self.ttft.labels(*labels).observe(record.ttft_s)
        if record.time_per_output_token_s is not None:
            self.tpot.labels(*labels).observe(record.time_per_output_token_s)

    def disagreement(self, model: str, kind: str, ours: int, theirs: int) -> None:
        """An upstream billed `theirs` tokens of `kind` (prompt, completion) where the
        gateway counted `ours`."""
        direction = "upstream_higher" if theirs > ours else "upstream_lower"
        self.usage_disagreement.labels(model, kind, direction).observe(abs(theirs - ours))

    def overclaim(self, model: str, upstream: str, kind: str, claimed: int, billed: int) -> None:
        """An upstream claimed `claimed` tokens of `kind` where `billed` were reserved."""
        self.usage_capped.labels(model, upstream, kind).inc()
        self.usage_capped_tokens.labels(model, upstream, kind).inc(claimed - billed)

    def reject(self, tenant_id: str | None, reason: str) -> None:
        tenant = self.tenant(tenant_id) if tenant_id is not None else NO_TENANT
        self._inc(self.rejections, tenant_id, (tenant, reason))

    def set_tenant_gauges(
        self, tenant_id: str, reserved: int, concurrent: int, spent: int, limit: int | None
    ) -> None:
        if tenant_id not in self.tenants.labelled:
            return  # gauges only for labelled tenants: the `other` sum would mean nothing
        self._set(self.reserved_micros, tenant_id, reserved)
        self._set(self.concurrent, tenant_id, concurrent)
        self._set(self.budget_spent, tenant_id, spent)
        if limit is not None:
            self._set(self.budget_limit, tenant_id, limit)

    def labelled_tenants(self) -> Iterable[str]:
        return sorted(self.tenants.labelled)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def _inc(
        self, metric: Counter, tenant_id: str | None, labels: tuple[str, ...], amount: float = 1
    ) -> None:
        metric.labels(*labels).inc(amount)
        if tenant_id is not None and labels[0] != OTHER:
            self._remember(tenant_id, metric, labels)

    def _set(self, metric: Gauge, tenant_id: str, value: float) -> None:
        labels = (self._names.get(tenant_id, tenant_id),)
        metric.labels(*labels).set(value)
        self._remember(tenant_id, metric, labels)

    def _remember(self, tenant_id: str, metric: Counter | Gauge, labels: tuple[str, ...]) -> None:
        """The series of a labelled tenant, by its id: dropped if it loses the label."""
        self._series.setdefault(tenant_id, set()).add((metric, labels))

    def _drop_tenant(self, tenant: str) -> None:
        for metric, labels in self._series.pop(tenant, ()):
            metric.remove(*labels)
