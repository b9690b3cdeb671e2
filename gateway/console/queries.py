"""Read-only questions the console asks of the usage ledger and the engine.

The ledger is `usage_events` (one row per finished request), read through its owner,
tenants/billing/ledger.py.
Administrators see every tenant; each filter narrows by tenant id, never by name alone.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any, Protocol

from sqlalchemy.ext.asyncio import AsyncSession

from gateway.dispatch.engine_client import IN_PROCESS, EngineClient, InProcessEngineClient
from gateway.dispatch.remote import RemoteEngineClient
from gateway.telemetry.metrics import GatewayMetrics
from gateway.telemetry.request import workload_class
from tenants.billing import ledger
from tenants.billing.ledger import UsageRow
from tenants.models import as_utc, utcnow

CSV_LIMIT = 100_000
OVERVIEW_WINDOW = timedelta(minutes=10)
OVERVIEW_BUCKET_S = 10
OVERVIEW_ROWS = 50_000


CSV_HEADER = [
    "request_id",
    "created_at",
    "tenant",
    "key",
    "model",
    "endpoint",
    "status",
    "finish_reason",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "cost_micros",
    "queue_ms",
    "ttft_ms",
    "e2e_ms",
    "error",
]


def csv_record(row: UsageRow) -> list[object]:
    event = row.event
    return [
        event.request_id,
        event.created_at.isoformat(),
        row.tenant,
        row.key_prefix,
        event.model,
        event.endpoint,
        event.status,
        event.finish_reason or "",
        event.prompt_tokens,
        event.cached_tokens,
        event.completion_tokens,
        event.cost_micros,
        "" if event.queue_ms is None else round(event.queue_ms, 3),
        "" if event.ttft_ms is None else round(event.ttft_ms, 3),
        "" if event.e2e_ms is None else round(event.e2e_ms, 3),
        event.error or "",
    ]


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


class Timings(Protocol):
    itl_ms: float | None
    e2e_ms: float | None
    ttft_ms: float | None
    completion_tokens: int


def inter_token_ms(event: Timings) -> float | None:
    """Mean gap between output tokens after the first, as the ledger recorded it; for older
    rows, (e2e - TTFT) / (tokens - 1)."""
    if event.itl_ms is not None:
        return event.itl_ms
    if event.e2e_ms is None or event.ttft_ms is None or event.completion_tokens < 2:
        return None
    return (event.e2e_ms - event.ttft_ms) / (event.completion_tokens - 1)


async def traffic(session: AsyncSession, now: datetime | None = None) -> dict[str, Any]:
    """Request and token rates per bucket, latency percentiles per workload class and
    outcomes, over the last OVERVIEW_WINDOW of the ledger."""
    now = now or utcnow()
    start = now - OVERVIEW_WINDOW
    # Only the columns charted: this runs every 2 s for each open overview. Past
    # OVERVIEW_ROWS requests in the window, the newest are kept.
    events = await ledger.latest_outcomes(session, start, OVERVIEW_ROWS)
    buckets = int(OVERVIEW_WINDOW.total_seconds()) // OVERVIEW_BUCKET_S
    requests = [0] * buckets
    tokens = [0] * buckets
    ttft: defaultdict[str, list[float]] = defaultdict(list)
    itl: defaultdict[str, list[float]] = defaultdict(list)
    outcomes: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    for event in events:
        index = min(
            buckets - 1,
            int((as_utc(event.created_at) - start).total_seconds()) // OVERVIEW_BUCKET_S,
        )
        requests[index] += 1
        tokens[index] += event.completion_tokens
        outcomes[event.status] += 1
        if event.status != "completed":
            reasons[f"{event.status}: {event.error or event.finish_reason or 'unknown'}"] += 1
        # Percentiles per class, so a flood of one kind cannot hide another's tail.
        kind = workload_class(event.endpoint, event.prompt_tokens)
        if event.ttft_ms is not None:
            ttft[kind].append(event.ttft_ms)
        gap = inter_token_ms(event)
        if gap is not None:
            itl[kind].append(gap)
    classes = sorted(set(ttft) | set(itl))
    return {
        "bucket_s": OVERVIEW_BUCKET_S,
        "start": start.timestamp(),
        "requests_per_s": [n / OVERVIEW_BUCKET_S for n in requests],
        "tokens_per_s": [n / OVERVIEW_BUCKET_S for n in tokens],
        "latency": [
            {
                "class": kind,
                "requests": len(ttft[kind]),
                "ttft_p50_ms": percentile(ttft[kind], 50),
                "ttft_p95_ms": percentile(ttft[kind], 95),
                "itl_p50_ms": percentile(itl[kind], 50),
                "itl_p95_ms": percentile(itl[kind], 95),
            }
            for kind in classes
        ],
        "outcomes": dict(outcomes),
        "not_completed_by_reason": dict(reasons.most_common(10)),
        "total_requests": len(events),
    }


def replicas(client: EngineClient | None) -> list[dict[str, Any]]:
    """Queue depth, KV cache use and prefix-cache hit rate of each engine replica."""
    if isinstance(client, InProcessEngineClient):
        stats = client.engine.stats()
        return [
            {
                "name": IN_PROCESS,
                "healthy": client.is_ready(),
                "running": stats.num_running,
                "waiting": stats.num_waiting,
                "kv_used_fraction": stats.kv_blocks_used / max(1, stats.kv_blocks_total),
                "prefix_cache_hit_rate": stats.prefix_cache_hit_rate,
                "busy_s": stats.busy_s,
                "batch_busy_s": stats.batch_busy_s,
            }
        ]
    if isinstance(client, RemoteEngineClient):
        return [
            {
                "name": replica.url,
                "healthy": replica.healthy,
                "running": replica.running,
                "waiting": replica.waiting,
                "kv_used_fraction": replica.kv_used_fraction,
                "prefix_cache_hit_rate": replica.prefix_cache_hit_rate,
                "busy_s": replica.busy_s,
                "batch_busy_s": replica.batch_busy_s,
            }
            for replica in client.replicas
        ]
    return []


def engine_time(client: EngineClient | None) -> tuple[float, float]:
    """Seconds the engine replicas spent stepping since they started, and of those the
    batch class's (each step's time split by its rows' tokens: Engine.batch_busy_s)."""
    rows = replicas(client)
    return sum(r["busy_s"] for r in rows), sum(r["batch_busy_s"] for r in rows)


async def tenant_series(
    session: AsyncSession, tenant_id: str, days: int = 14, now: datetime | None = None
) -> list[dict[str, Any]]:
    """Tokens, requests and cost per day for one tenant (its usage chart)."""
    now = now or utcnow()
    first_day = (now - timedelta(days=days - 1)).date()
    since = datetime.combine(first_day, datetime.min.time(), tzinfo=now.tzinfo)
    rows = await ledger.tenant_usage_since(session, tenant_id, since)
    days_list = [first_day + timedelta(days=offset) for offset in range(days)]
    totals = {day: [0, 0, 0] for day in days_list}
    for created, prompt, completion, cost in rows:
        day = created.date()
        if day in totals:
            totals[day][0] += 1
            totals[day][1] += prompt + completion
            totals[day][2] += cost
    return [
        {"day": day.isoformat(), "requests": r, "tokens": t, "cost_micros": c}
        for day, (r, t, c) in totals.items()
    ]


def rejections(metrics: GatewayMetrics) -> dict[str, int]:
    """Requests turned away since this gateway started (rate limit, budget, auth...), by
    reason, summed over tenants: the telemetry counter behind /metrics."""
    totals: Counter[str] = Counter()
    for family in metrics.rejections.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                totals[sample.labels["reason"]] += int(sample.value)
    return dict(totals.most_common())
