"""Bounded tenant labels and the gateway's metric families."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from backend.outputs import EngineStats
from gateway.telemetry.metrics import OTHER, GatewayMetrics, RequestObservation, TenantLabels
from gateway.telemetry.request import workload_class


def test_first_tenants_get_labels_then_other() -> None:
    labels = TenantLabels(top_n=2)
    assert labels.label("a") == "a"
    assert labels.label("b") == "b"
    assert labels.label("c") == OTHER
    assert labels.label("a") == "a"


def test_a_busy_newcomer_displaces_the_quietest() -> None:
    evicted: list[str] = []
    labels = TenantLabels(top_n=2, on_evict=evicted.append)
    for tenant in ("a", "a", "a", "b"):
        labels.label(tenant)
    results = [labels.label("c") for _ in range(3)]
    assert results == [OTHER, "c", "c"]  # c reached twice b's count on its second request
    assert evicted == ["b"]
    assert labels.labelled == {"a", "c"}
    assert labels.label("b") == OTHER


def test_counts_stay_bounded_with_many_tenants() -> None:
    labels = TenantLabels(top_n=3)
    for i in range(500):
        labels.label(f"t{i}")
    assert len(labels.counts) <= 12
    assert len(labels.labelled) == 3


def _record(tenant: str, **changes: object) -> RequestObservation:
    base: dict[str, object] = {
        "tenant": tenant,
        "model": "m",
        "status": "completed",
        "workload_class": "chat",
        "priority": 1,
        "input_tokens": 10,
        "cached_tokens": 4,
        "output_tokens": 5,
        "duration_s": 0.2,
        "queue_s": 0.01,
        "ttft_s": 0.05,
        "time_per_output_token_s": 0.02,
    }
    base.update(changes)
    return RequestObservation(**base)  # type: ignore[arg-type]


def _samples(metrics: GatewayMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = metrics.exposition().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_tenant_series_never_exceed_the_bound() -> None:
    metrics = GatewayMetrics(top_tenants=2)
    for tenant in ["a"] * 5 + ["b"] + ["c"] * 3 + ["d", "e"]:
        metrics.observe(_record(tenant))
    tenants = {
        dict(labels)["tenant"]
        for (name, labels) in _samples(metrics)
        if name == "tollgate_requests_total"
    }
    assert tenants == {"a", "c", OTHER}  # b was displaced by c; its series went
    total = sum(
        v for (name, _), v in _samples(metrics).items() if name == "tollgate_requests_total"
    )
    assert total == 10  # 11 requests; b's one left with its series when c displaced it


def test_one_observation_per_request_in_each_histogram() -> None:
    metrics = GatewayMetrics()
    metrics.observe(_record("a"))
    metrics.observe(_record("a", ttft_s=None, time_per_output_token_s=None, output_tokens=0))
    samples = _samples(metrics)
    labels = (("model", "m"), ("priority", "1"), ("workload_class", "chat"))
    assert samples[("gen_ai_server_request_duration_seconds_count", labels)] == 2
    assert samples[("gen_ai_server_time_to_first_token_seconds_count", labels)] == 1
    assert samples[("gen_ai_server_time_per_output_token_seconds_count", labels)] == 1
    assert samples[("tollgate_queue_time_seconds_count", labels)] == 2
    output = (("model", "m"), ("tenant", "a"), ("type", "output"))
    assert samples[("tollgate_tokens_total", output)] == 5


def test_rejections_and_engine_stats() -> None:
    metrics = GatewayMetrics()
    metrics.reject(None, "authentication")
    metrics.reject("a", "budget")
    metrics.watch_engine(
        lambda: EngineStats(
            num_running=2,
            num_waiting=3,
            kv_blocks_total=10,
            kv_blocks_used=4,
            kv_blocks_free=6,
            block_size=16,
            num_steps=7,
            prefix_cache_queries=100,
            prefix_cache_hits=25,
        )
    )
    samples = _samples(metrics)
    assert samples[
        ("tollgate_rejections_total", (("reason", "authentication"), ("tenant", "none")))
    ]
    assert samples[("tollgate_rejections_total", (("reason", "budget"), ("tenant", "a")))] == 1
    assert samples[("tollgate_engine_requests_waiting", ())] == 3
    assert samples[("tollgate_engine_kv_cache_usage_ratio", ())] == 0.4
    assert samples[("tollgate_engine_prefix_cache_hit_ratio", ())] == 0.25
    assert samples[("tollgate_engine_prefix_cache_hits_total", ())] == 25


def test_workload_class_rule() -> None:
    assert workload_class("chat.completions", 200) == "chat"
    assert workload_class("completions", 200) == "completion"
    assert workload_class("chat.completions", 1024) == "document"


def test_tenants_are_labelled_by_name_and_dropped_by_id() -> None:
    metrics = GatewayMetrics(top_tenants=1)
    metrics.name_tenant("id-a", "acme")
    metrics.name_tenant("id-b", "globex")
    metrics.observe(_record("id-a"))
    metrics.set_tenant_gauges("id-a", reserved=1, concurrent=1, spent=2, limit=10)
    assert ("tollgate_tenant_budget_spent_micros", (("tenant", "acme"),)) in _samples(metrics)
    for _ in range(2):  # globex displaces acme: acme's series go, gauges included
        metrics.observe(_record("id-b"))
    tenants = {dict(labels).get("tenant") for (_, labels) in _samples(metrics)}
    assert tenants == {None, "globex", OTHER}
    assert list(metrics.labelled_tenants()) == ["id-b"]  # the quota store's key: the id
