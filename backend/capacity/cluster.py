"""Sizing a cluster: the simulator (the real Scheduler and BlockManager on a virtual clock,
stepped by the planner's cost model) at increasing replica counts, until every class meets
its TTFT and inter-token p95 SLOs.

Arrivals are dealt to the replicas round-robin in arrival order (each replica sees a
thinned copy of the same traffic; the gateway's affinity and least-load routing are not
modelled), and each replica is one engine with the planner's KV pool."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise

from backend.capacity.errors import CapacityInputError
from backend.config import EngineConfig
from backend.sim.cost import CostModel
from backend.sim.report import percentile
from backend.sim.simulator import RequestRecord, SimResult, Simulator
from backend.sim.trace import Arrival, Stream

DEFAULT_TTFT_SLO_S = 1.0
DEFAULT_ITL_SLO_S = 0.1
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


@dataclass(frozen=True)
class Slo:
    ttft_s: float = DEFAULT_TTFT_SLO_S  # p95 of time to first token
    itl_s: float = DEFAULT_ITL_SLO_S  # p95 of the gaps between tokens


@dataclass(frozen=True)
class ClassFigures:
    name: str
    count: int
    finished: int
    ttft: tuple[float, float, float]  # p50, p95, p99 seconds
    itl: tuple[float, float, float]
    queue_p95: float
    slo: Slo

    @property
    def met(self) -> bool:
        return (
            self.finished == self.count
            and self.ttft[1] <= self.slo.ttft_s
            and self.itl[1] <= self.slo.itl_s
        )


@dataclass(frozen=True)
class ReplicaFigures:
    replicas: int
    classes: list[ClassFigures]
    goodput_rps: float  # finished requests within both SLOs, per second
    goodput_tps: float  # their output tokens per second
    kv_peak: float  # share of a replica's KV blocks in use: the worst replica's peak
    kv_mean: float  # mean over replicas and steps
    rejected: int
    preemptions: int
    duration_s: float

    @property
    def meets_slos(self) -> bool:
        return all(c.met for c in self.classes)


def parse_range(text: str, what: str) -> tuple[int, int]:
    match = _RANGE.match(text.strip())
    if not match or int(match.group(1)) < 1:
        raise CapacityInputError("--class", f"--class: {what}={text!r} is not N or LO-HI (N >= 1)")
    low, high = int(match.group(1)), int(match.group(2) or match.group(1))
    if high < low:
        raise CapacityInputError("--class", f"--class: {what}={text!r} ends below its start")
    return low, high


def _fields(spec: str, flag: str) -> tuple[str, dict[str, str]]:
    name, _, rest = spec.partition(":")
    pairs = [item.partition("=") for item in rest.split(",") if item.strip()]
    if not name.strip() or any(not sep for _, sep, _ in pairs):
        raise CapacityInputError(flag, f"{flag} {spec!r}: expected NAME:key=value,...")
    return name.strip(), {k.strip(): v.strip() for k, _, v in pairs}


def _seconds(fields: dict[str, str], key: str, default: float, flag: str) -> float:
    try:
        value = float(fields.get(key, default))
    except ValueError:
        raise CapacityInputError(flag, f"{flag}: {key}={fields[key]!r} is not a number") from None
    if not value > 0:
        raise CapacityInputError(flag, f"{flag}: {key} must be positive")
    return value


def parse_class(spec: str, end_s: float) -> tuple[Stream, Slo]:
    """NAME:rate=R,prompt=LO-HI,output=LO-HI[,ttft=S][,itl=S][,priority=P]"""
    name, fields = _fields(spec, "--class")
    unknown = set(fields) - {"rate", "prompt", "output", "ttft", "itl", "priority"}
    missing = {"rate", "prompt", "output"} - set(fields)
    if unknown or missing:
        raise CapacityInputError(
            "--class", f"--class {spec!r}: needs rate, prompt, output; unknown {sorted(unknown)}"
        )
    slo = Slo(
        _seconds(fields, "ttft", DEFAULT_TTFT_SLO_S, "--class"),
        _seconds(fields, "itl", DEFAULT_ITL_SLO_S, "--class"),
    )
    stream = Stream(
        name,
        rate=_seconds(fields, "rate", 1.0, "--class"),
        prompt_tokens=parse_range(fields["prompt"], "prompt"),
        output_tokens=parse_range(fields["output"], "output"),
        end=end_s,
        priority=_priority(fields.get("priority", "0")),
        ttft_slo_s=slo.ttft_s,
    )
    return stream, slo


def _priority(text: str) -> int:
    if not text.isdigit():
        raise CapacityInputError("--class", f"--class: priority={text!r} is not 0-9")
    return int(text)


def parse_slo(spec: str) -> tuple[str, Slo]:
    """NAME:ttft=S,itl=S"""
    name, fields = _fields(spec, "--slo")
    if set(fields) - {"ttft", "itl"}:
        raise CapacityInputError("--slo", f"--slo {spec!r}: only ttft and itl")
    return name, Slo(
        _seconds(fields, "ttft", DEFAULT_TTFT_SLO_S, "--slo"),
        _seconds(fields, "itl", DEFAULT_ITL_SLO_S, "--slo"),
    )


def deal(trace: list[Arrival], replicas: int) -> list[list[Arrival]]:
    """Round-robin in arrival order."""
    return [trace[i::replicas] for i in range(replicas)]


def _gaps(record: RequestRecord) -> list[float]:
    return [b - a for a, b in pairwise(record.token_times)]


def _ttft(record: RequestRecord) -> float | None:
    if record.first_token is None:
        return None
    return record.first_token - record.arrival.time


def _good(record: RequestRecord, slo: Slo) -> bool:
    """Finished, first token within the TTFT SLO, and its own p95 gap within the ITL's."""
    ttft = _ttft(record)
    gaps = _gaps(record)
    return (
        record.outcome == "finished"
        and ttft is not None
        and ttft <= slo.ttft_s
        and (not gaps or percentile(gaps, 95) <= slo.itl_s)
    )


def _triple(values: list[float]) -> tuple[float, float, float]:
    return (percentile(values, 50), percentile(values, 95), percentile(values, 99))


def _class_figures(name: str, records: list[RequestRecord], slo: Slo) -> ClassFigures:
    ttfts = [t for r in records if (t := _ttft(r)) is not None]
    queue = [r.first_scheduled - r.arrival.time for r in records if r.first_scheduled is not None]
    return ClassFigures(
        name=name,
        count=len(records),
        finished=sum(r.outcome == "finished" for r in records),
        ttft=_triple(ttfts),
        itl=_triple([g for r in records for g in _gaps(r)]),
        queue_p95=percentile(queue, 95),
        slo=slo,
    )


def simulate(
    trace: list[Arrival],
    replicas: int,
    config: EngineConfig,
    cost: CostModel,
    num_kv_blocks: int,
    slos: dict[str, Slo],
) -> ReplicaFigures:
    results: list[SimResult] = [
        Simulator(config, cost, num_kv_blocks).run(part) for part in deal(trace, replicas)
    ]
    records = [r for result in results for r in result.records.values()]
    names = sorted({r.arrival.stream.name for r in records})
    slo_of = {name: slos.get(name, Slo()) for name in names}
    good = [r for r in records if _good(r, slo_of[r.arrival.stream.name])]
    span = max((result.duration_s for result in results), default=0.0) or 1e-9
    return ReplicaFigures(
        replicas=replicas,
        classes=[
            _class_figures(n, [r for r in records if r.arrival.stream.name == n], slo_of[n])
            for n in names
        ],
        goodput_rps=len(good) / span,
        goodput_tps=sum(len(r.token_times) for r in good) / span,
        kv_peak=max((result.kv_peak_fraction for result in results), default=0.0),
        kv_mean=sum(result.kv_mean_fraction for result in results) / max(1, len(results)),
        rejected=sum(r.outcome in ("overloaded", "deadline_exceeded") for r in records),
        preemptions=sum(result.num_preemptions for result in results),
        duration_s=span,
    )


def size_cluster(
    trace: list[Arrival],
    config: EngineConfig,
    cost: CostModel,
    num_kv_blocks: int,
    slos: dict[str, Slo],
    max_replicas: int,
    progress: Callable[[int, int, bool], None] | None = None,
) -> tuple[list[ReplicaFigures], int | None]:
    """Figures at 1, 2, ... replicas, stopping at the first count meeting every SLO (the
    second value; None if none up to `max_replicas` does). `progress(done, of, finished)`
    hears of each count."""
    if not trace:
        raise CapacityInputError("--class", "the workload has no requests")
    if max_replicas < 1:
        raise CapacityInputError("--max-replicas", "--max-replicas must be at least 1")
    tried: list[ReplicaFigures] = []
    for n in range(1, max_replicas + 1):
        if progress:
            progress(n - 1, max_replicas, False)
        figures = simulate(trace, n, config, cost, num_kv_blocks, slos)
        tried.append(figures)
        if figures.meets_slos:
            break
    if progress:
        progress(len(tried), max_replicas, True)
    return tried, tried[-1].replicas if tried[-1].meets_slos else None
