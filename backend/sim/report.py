"""Figures from a simulation: TTFT, inter-token latency and queue time p50/p95/p99 per
class and priority; goodput; rejections; preemptions; the worst wait of the lowest
priority."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from backend.config import EngineConfig
from backend.sim.simulator import RequestRecord, SimResult


def of_stream(result: SimResult, name: str) -> list[RequestRecord]:
    return [r for r in result.records.values() if r.arrival.stream.name == name]


def residency(result: SimResult) -> float:
    """R: the longest admission-to-finish of a request that was never preempted."""
    return max(
        r.end - r.first_scheduled
        for r in result.records.values()
        if r.outcome == "finished"
        and r.preemptions == 0
        and r.end is not None
        and r.first_scheduled is not None
    )


def starvation_bound(config: EngineConfig, priority: int, result: SimResult) -> float:
    """backend/SCHEDULING.md: wait <= (p + 1) * I + (ceil(Q / S) + 1) * R with the
    adaptive budget's express lane (p * I + ... without it), R measured in the same run."""
    assert config.aging_interval_s is not None
    turns = math.ceil(config.max_waiting_requests / config.seqs_limit) + 1
    classes = priority + 1 if config.adaptive_step_budget else priority
    return classes * config.aging_interval_s + turns * residency(result)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


@dataclass(frozen=True)
class Row:
    name: str  # "chat p0"
    count: int
    ttft: tuple[float, float, float]  # p50, p95, p99 seconds
    itl: tuple[float, float, float]
    queue: tuple[float, float, float]


@dataclass(frozen=True)
class Report:
    rows: list[Row]
    duration_s: float
    num_steps: int
    finished: int
    goodput_rps: float  # finished requests whose TTFT met their stream's SLO, per second
    goodput_tps: float  # their output tokens per second
    outcomes: dict[str, int]  # finished / cancelled / overloaded / deadline_exceeded / waiting
    preemptions: int
    priority_preemptions: int
    lowest_priority: int
    worst_lowest_wait_s: float  # queue time; until the end if it never started

    def format(self) -> str:
        lines = [
            f"{'class':<14}{'n':>6}  {'TTFT p50/p95/p99 (s)':<24}{'ITL p50/p95/p99 (ms)':<24}"
            "queue p50/p95/p99 (s)"
        ]
        for r in self.rows:
            ttft = "/".join(f"{v:.2f}" for v in r.ttft)
            itl = "/".join(f"{v * 1000:.1f}" for v in r.itl)
            queue = "/".join(f"{v:.2f}" for v in r.queue)
            lines.append(f"{r.name:<14}{r.count:>6}  {ttft:<24}{itl:<24}{queue}")
        outcomes = ", ".join(f"{k} {v}" for k, v in sorted(self.outcomes.items()))
        lines += [
            f"{self.duration_s:.1f} s simulated in {self.num_steps} steps; {outcomes}",
            f"goodput: {self.goodput_rps:.2f} req/s, {self.goodput_tps:.0f} output tok/s "
            "(TTFT within SLO)",
            f"preemptions: {self.preemptions} ({self.priority_preemptions} for priority)",
            f"worst wait of priority {self.lowest_priority}: {self.worst_lowest_wait_s:.2f} s",
        ]
        return "\n".join(lines)


def queue_time(record: RequestRecord) -> float:
    """Arrival to first scheduled; for one never scheduled, arrival to its end."""
    start = record.first_scheduled if record.first_scheduled is not None else record.end
    return (start or record.arrival.time) - record.arrival.time


def _triple(values: list[float]) -> tuple[float, float, float]:
    return (percentile(values, 50), percentile(values, 95), percentile(values, 99))


def summarize(result: SimResult) -> Report:
    groups: dict[tuple[str, int], list[RequestRecord]] = {}
    for rec in result.records.values():
        key = (rec.arrival.stream.name, rec.arrival.stream.priority)
        groups.setdefault(key, []).append(rec)
    rows = []
    for (name, priority), recs in sorted(groups.items()):
        started = [r for r in recs if r.first_token is not None]
        ttft = [r.first_token - r.arrival.time for r in started if r.first_token is not None]
        itl = [
            b - a for r in started for a, b in zip(r.token_times, r.token_times[1:], strict=False)
        ]
        queue = [queue_time(r) for r in recs if r.first_scheduled is not None]
        rows.append(
            Row(f"{name} p{priority}", len(recs), _triple(ttft), _triple(itl), _triple(queue))
        )
    good = [
        r
        for r in result.records.values()
        if r.outcome == "finished"
        and r.first_token is not None
        and r.first_token - r.arrival.time <= r.arrival.stream.ttft_slo_s
    ]
    span = max(result.duration_s, 1e-9)
    records = list(result.records.values())
    lowest = max((r.arrival.stream.priority for r in records), default=0)
    return Report(
        rows=rows,
        duration_s=result.duration_s,
        num_steps=result.num_steps,
        finished=sum(r.outcome == "finished" for r in records),
        goodput_rps=len(good) / span,
        goodput_tps=sum(len(r.token_times) for r in good) / span,
        outcomes=dict(Counter(r.outcome for r in records)),
        preemptions=result.num_preemptions,
        priority_preemptions=result.num_priority_preemptions,
        lowest_priority=lowest,
        worst_lowest_wait_s=max(
            (queue_time(r) for r in records if r.arrival.stream.priority == lowest), default=0.0
        ),
    )
