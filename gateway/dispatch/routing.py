"""Choosing a target in a pool (Tollgate backend replicas, or an OpenAI-compatible
model's upstreams): prefix affinity, unless that target is clearly busier for its weight.

Affinity uses weighted rendezvous hashing of (tenant, prompt prefix), so requests that
share a system prompt land where its KV blocks are already cached, each target gets keys
in proportion to its weight, and only the keys of a target that goes away move.

A LoRA adapter's requests go to a target that reports the adapter loaded (the same
slack for load), else to the adapter's own rendezvous choice, so that one target loads
it and the next requests find it there; any target serves when those are too busy.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

AFFINITY_PREFIX_TOKENS = 256  # long enough to cover a shared system prompt
AFFINITY_SLACK = 4.0  # extra load (in requests per unit of weight) accepted to keep a hit
# A target too busy to answer its probe in time is slow, not dead: only this many late
# answers in a row take it out of routing (a refused connection or a stopped engine does
# at once). One late poll used to, and with the other replica restarting, left none.
MISSED_POLLS_TO_DOWN = 3


@dataclass
class Replica:
    url: str
    weight: int = 1  # its share of the keys, and of the load it takes, against the others
    healthy: bool = True
    missed_polls: int = 0  # probes in a row that got no answer in time
    in_flight: int = 0  # requests this gateway has open on it
    waiting: int = 0  # from its last stats report
    running: int = 0
    interactive: int = 0  # of those running or waiting, below the batch class
    kv_used_fraction: float = 0.0
    prefix_cache_hit_rate: float = 0.0  # for the console; routing does not use it
    busy_s: float = 0.0  # for the console too: seconds spent stepping since it started,
    batch_busy_s: float = 0.0  # and of those, the batch class's
    overclaims: int = 0  # answers whose usage exceeded what was reserved: suspect
    adapters: frozenset[str] = frozenset()  # LoRA adapters it reports loaded or in use

    def load(self) -> float:
        """Queued work in requests, with a full KV cache counting like a few more."""
        return max(self.in_flight, self.running) + self.waiting + 4.0 * self.kv_used_fraction

    def pressure(self) -> float:
        return self.load() / self.weight

    def missed(self) -> None:
        """A probe got no answer in time."""
        self.missed_polls += 1
        if self.missed_polls >= MISSED_POLLS_TO_DOWN:
            self.healthy = False

    def answered(self, healthy: bool) -> None:
        self.missed_polls = 0
        self.healthy = healthy


def affinity_key(tenant: str | None, prompt: Sequence[int]) -> bytes:
    head = ",".join(map(str, prompt[:AFFINITY_PREFIX_TOKENS]))
    return f"{tenant or ''}|{head}".encode()


def _score(key: bytes, replica: Replica) -> float:
    """Weighted rendezvous (-weight / ln u, u uniform in (0, 1) from the hash): a target
    wins a key with probability weight / total weight. With equal weights the order is
    the hash's, as it was before weights."""
    digest = hashlib.blake2b(key + replica.url.encode(), digest_size=8).digest()
    uniform = (int.from_bytes(digest, "big") + 1) / (2**64 + 1)
    return -replica.weight / math.log(uniform)


def pick(
    replicas: Sequence[Replica],
    key: bytes,
    exclude: Collection[str] = (),
    adapter: str | None = None,
) -> Replica | None:
    """`adapter`: the request's LoRA adapter, whose holders come first."""
    candidates = [r for r in replicas if r.healthy and r.url not in exclude]
    if not candidates:
        return None
    least = min(candidates, key=Replica.pressure)
    if adapter is not None:
        holders = [r for r in candidates if adapter in r.adapters]
        home = _preferred(holders, key) if holders else _preferred(candidates, adapter.encode())
        if home.pressure() <= least.pressure() + AFFINITY_SLACK:
            return home
    preferred = _preferred(candidates, key)
    return preferred if preferred.pressure() <= least.pressure() + AFFINITY_SLACK else least


def _preferred(candidates: Sequence[Replica], key: bytes) -> Replica:
    return max(candidates, key=lambda r: _score(key, r))
