"""Open-loop arrival traces: independent Poisson streams, each a class of requests (chat:
short prompts, long outputs; document: long prompts, short outputs) with a priority, a
tenant and optional deadlines and cancellations. A burst is a stream with a high rate over
a short window. Seeded: the same streams and seed give the same trace."""

from __future__ import annotations

import random
from dataclasses import dataclass


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
