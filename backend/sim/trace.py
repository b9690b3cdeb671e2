"""Open-loop arrival traces: independent Poisson streams, each a class of requests (chat:
short prompts, long outputs; document: long prompts, short outputs) with a priority, a
tenant and optional deadlines and cancellations. A burst is a stream with a high rate over
a short window. Seeded: the same streams and seed give the same trace."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, replace
from pathlib import Path


@dataclass(frozen=True)
class Stream:
    name: str  # the class reported on: "chat", "document", ...
    rate: float  # arrivals per second (Poisson)
    prompt_tokens: tuple[int, int]  # uniform, inclusive
    output_tokens: tuple[int, int]
    start: float = 0.0
    end: float = 60.0
    priority: int = 0
    tenant: str = "default"
    weight: int = 1
    deadline_s: float | None = None  # first token due this long after arrival
    cancel_fraction: float = 0.0  # of requests the client abandons ...
    cancel_after_s: tuple[float, float] = (0.5, 5.0)  # ... this long after arrival
    ttft_slo_s: float = 1.0  # goodput counts requests whose first token met this


@dataclass(frozen=True)
class Arrival:
    time: float
    request_id: str
    stream: Stream
    prompt_tokens: int
    output_tokens: int
    cancel_at: float | None = None


def make_trace(streams: list[Stream], seed: int = 0) -> list[Arrival]:
    rng = random.Random(seed)
    arrivals: list[Arrival] = []
    for s in streams:
        t = s.start
        while s.rate > 0:
            t += rng.expovariate(s.rate)
            if t >= s.end:
                break
            cancel_at = None
            if rng.random() < s.cancel_fraction:
                cancel_at = t + rng.uniform(*s.cancel_after_s)
            arrivals.append(
                Arrival(
                    t,
                    f"{s.name}-{len(arrivals)}",
                    s,
                    rng.randint(*s.prompt_tokens),
                    rng.randint(*s.output_tokens),
                    cancel_at,
                )
            )
    arrivals.sort(key=lambda a: a.time)
    return arrivals


def save_trace(arrivals: list[Arrival], path: Path) -> None:
    """JSON Lines, one arrival a line: time, class, prompt_tokens, output_tokens and,
    where set, priority, tenant, cancel_at."""
    with path.open("w", encoding="utf-8") as out:
        for a in arrivals:
            row: dict[str, object] = {
                "time": a.time,
                "class": a.stream.name,
                "prompt_tokens": a.prompt_tokens,
                "output_tokens": a.output_tokens,
                "priority": a.stream.priority,
                "tenant": a.stream.tenant,
            }
            if a.cancel_at is not None:
                row["cancel_at"] = a.cancel_at
            out.write(json.dumps(row) + "\n")


def load_trace(path: Path, classes: dict[str, Stream] | None = None) -> list[Arrival]:
    """A trace written by save_trace (or by hand). Each class becomes a Stream (rate 0:
    it only labels arrivals); `classes` supplies them, e.g. with their TTFT SLOs. Raises
    ValueError naming the line at fault."""
    known = dict(classes or {})
    arrivals: list[Arrival] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            name = str(row["class"])
            base = known.setdefault(
                name, Stream(name, rate=0.0, prompt_tokens=(1, 1), output_tokens=(1, 1))
            )
            stream = replace(
                base,
                priority=int(row.get("priority", base.priority)),
                tenant=str(row.get("tenant", base.tenant)),
            )
            arrival = Arrival(
                float(row["time"]),
                f"{name}-{len(arrivals)}",
                stream,
                int(row["prompt_tokens"]),
                int(row["output_tokens"]),
                None if row.get("cancel_at") is None else float(row["cancel_at"]),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{number}: not an arrival ({exc!r})") from None
        if arrival.prompt_tokens < 1 or arrival.output_tokens < 1 or arrival.time < 0:
            raise ValueError(f"{path}:{number}: times must be >= 0 and token counts >= 1")
        arrivals.append(arrival)
    arrivals.sort(key=lambda a: a.time)
    return arrivals
