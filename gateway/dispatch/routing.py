"""Choosing a backend replica: prefix affinity, unless that replica is clearly busier.

Affinity uses rendezvous hashing of (tenant, prompt prefix), so requests that share a
system prompt land where its KV blocks are already cached, and only the keys of a dead
replica move when it goes away.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Sequence
from dataclasses import dataclass

AFFINITY_PREFIX_TOKENS = 256  # long enough to cover a shared system prompt
AFFINITY_SLACK = 4.0  # extra load (in requests) accepted to keep a cache hit


@dataclass
class Replica:
    url: str
    healthy: bool = True
    missed_polls: int = 0  # stats polls in a row that got no answer in time
    in_flight: int = 0  # requests this gateway has open on it
    waiting: int = 0  # from its last stats report
    running: int = 0
    kv_used_fraction: float = 0.0
    prefix_cache_hit_rate: float = 0.0  # for the console; routing does not use it

    def load(self) -> float:
        """Queued work in requests, with a full KV cache counting like a few more."""
        return max(self.in_flight, self.running) + self.waiting + 4.0 * self.kv_used_fraction


def affinity_key(tenant: str | None, prompt: Sequence[int]) -> bytes:
    head = ",".join(map(str, prompt[:AFFINITY_PREFIX_TOKENS]))
    return f"{tenant or ''}|{head}".encode()


def _score(key: bytes, url: str) -> int:
    return int.from_bytes(hashlib.blake2b(key + url.encode(), digest_size=8).digest(), "big")


def pick(replicas: Sequence[Replica], key: bytes, exclude: Collection[str] = ()) -> Replica | None:
    candidates = [r for r in replicas if r.healthy and r.url not in exclude]
    if not candidates:
        return None
    preferred = max(candidates, key=lambda r: _score(key, r.url))
    least = min(candidates, key=Replica.load)
    return preferred if preferred.load() <= least.load() + AFFINITY_SLACK else least
