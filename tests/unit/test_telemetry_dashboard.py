"""The Grafana dashboard and the collector config in infra/ match what the code exports."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from backend.outputs import EngineStats, RequestOutput
from backend.telemetry import EngineRequestMetrics, EngineStatsCollector, RequestTimeline
from gateway.telemetry.metrics import GatewayMetrics, RequestObservation

INFRA = Path(__file__).resolve().parents[2] / "infra"
METRIC = re.compile(r"\b(?:gen_ai|tollgate)_[a-z0-9_]+\b")


def _stats() -> EngineStats:
    return EngineStats(
        num_running=1,
        num_waiting=0,
        kv_blocks_total=8,
        kv_blocks_used=1,
        kv_blocks_free=7,
        block_size=16,
        num_steps=1,
    )


def _exported() -> set[str]:
    """Every sample name the gateway (embedded engine included) and a backend export."""
    gateway = GatewayMetrics()
    gateway.watch_engine(_stats)
    gateway.observe(
        RequestObservation("t", "m", "completed", "chat", 0, 3, 0, 2, 0.1, 0.01, 0.05, 0.02)
    )
    gateway.reject("t", "rpm")
    gateway.set_tenant_gauges("t", reserved=1, concurrent=1, spent=1, limit=10)
    backend = CollectorRegistry()
    backend.register(EngineStatsCollector(_stats))
    timeline = RequestTimeline()
    timeline.observe(
        RequestOutput("r", "", [1, 2], True, "stop", 3, 2, 0, 1.0, 1.1, 1.2, [1.2, 1.3])
    )
    EngineRequestMetrics(backend).observe(0, timeline, 1.4, aborted=False)
    texts = [gateway.exposition().decode(), generate_latest(backend).decode()]
    return {
        sample.name
        for text in texts
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _expressions(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["expr"]] if isinstance(node.get("expr"), str) else []
        return found + [e for value in node.values() for e in _expressions(value)]
    if isinstance(node, list):
        return [e for item in node for e in _expressions(item)]
    return []


def test_every_dashboard_query_uses_exported_metrics() -> None:
    dashboard = json.loads((INFRA / "grafana" / "tollgate-dashboard.json").read_text())
    expressions = _expressions(dashboard["panels"])
    assert len(expressions) >= 12
    used = {name for expr in expressions for name in METRIC.findall(expr)}
    exported = _exported()
    assert used - exported == set()
    # The panels the issue asks for are there.
    for name in (
        "gen_ai_server_time_to_first_token_seconds_bucket",
        "gen_ai_server_time_per_output_token_seconds_bucket",
        "tollgate_queue_time_seconds_bucket",
        "tollgate_requests_total",
        "tollgate_tokens_total",
        "tollgate_engine_kv_cache_usage_ratio",
        "tollgate_engine_prefix_cache_hits_total",
        "tollgate_engine_requests_waiting",
        "tollgate_engine_preemptions_total",
        "tollgate_rejections_total",
        "tollgate_tenant_budget_spent_micros",
        "tollgate_engine_time_to_first_token_seconds_bucket",
    ):
        assert name in used, name


def test_collector_pipelines_use_defined_components() -> None:
    config = yaml.safe_load((INFRA / "otel-collector.yaml").read_text())
    pipelines = config["service"]["pipelines"]
    assert set(pipelines) == {"traces", "metrics"}
    assert "otlp" in pipelines["traces"]["receivers"]
    for pipeline in pipelines.values():
        for kind in ("receivers", "processors", "exporters"):
            assert set(pipeline[kind]) <= set(config[kind]), (kind, pipeline[kind])
    jobs = config["receivers"]["prometheus"]["config"]["scrape_configs"]
    assert {job["metrics_path"] for job in jobs} == {"/metrics"}
