"""Who runs next: the scheduling policy, kept apart from the scheduler's mechanism (budget,
chunks, blocks). Everything here is documented, knob by knob, in backend/SCHEDULING.md.

Ranking. A request's effective priority is `priority - floor(waited / aging_interval_s)`:
it rises one class per interval it has been in the engine. Since
`p - floor((now - arrival) / I) == -floor((now - (arrival + p * I)) / I)`, sorting by the
static key `arrival + p * I` orders requests by effective priority at every instant, so
the waiting queue is sorted once, on insertion, and never re-sorted per step. A preempted
request keeps its arrival time, hence its age and its place.

Between tenants, a waiting request ages from its arrival or from its tenant's last
service (a step that computed any of its tokens, or an admission), whichever is later: a
tenant rises one class per interval it goes unserved. Aging from arrival alone handed
the engine to whoever held a backlog (issue 32): a tenant streaming 32 requests with 168
more queued saw its queue age to class 0 while it was served every step, and another
tenant's fresh request of its own class (or of class 0) waited for its streams to end.
Among heads of the same class, tenants share the token budget by weight: the tenant
served the fewest tokens per unit of weight goes first (deficit round robin on scheduled
tokens). Within a tenant, requests age from their arrival; ties go to the earliest
deadline, then to the earliest arrival.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Iterator

from backend.config import EngineConfig
from backend.engine.request import Request, RequestStatus
from backend.errors import OverloadedError

# How far into a tenant's queue the deadline tie-break looks: the queue is sorted by
# class and arrival, so only the few at its head can share the head's class and still be
# cheap to compare every admission.
TIE_WINDOW = 8
# How far into a tenant's queue the scheduler looks for short interactive prompts that
# may jump the queue (backend/SCHEDULING.md, "Express lane").
EXPRESS_WINDOW = 64
_EMA = 0.2  # weight of the newest step in the throughput estimate


class Ranking:
    """Effective priority with aging, and the static key that sorts by it."""

    def __init__(self, aging_interval_s: float | None) -> None:
        self.aging = aging_interval_s

    def key(self, req: Request) -> tuple[float, float, int]:
        """Completion 0 of an n > 1 request goes before its forks (same arrival)."""
        if self.aging is None:
            return (req.priority, req.arrival_time, req.index)
        return (req.arrival_time + req.priority * self.aging, req.arrival_time, req.index)

    def effective(self, req: Request, now: float, since: float | None = None) -> int:
        """Aged from `since` (default: its arrival)."""
        if self.aging is None:
            return req.priority
        waited = now - (req.arrival_time if since is None else since)
        return req.priority - math.floor(waited / self.aging)


def _deadline_order(req: Request) -> tuple[float, float, int]:
    return (math.inf if req.deadline is None else req.deadline, req.arrival_time, req.index)


class FairShare:
    """Tokens served per tenant, divided by its weight. A tenant that starts waiting again
    starts level with the least-served tenant already waiting: time spent not competing
    (idle, or served all it asked for) earns no credit to spend later in a burst, and
    service in an earlier contention is no debt that a newcomer could collect on."""

    def __init__(self) -> None:
        self.served: dict[str | None, float] = {}

    def level(self, tenant: str | None, competitors: Iterable[str | None]) -> None:
        floor = min((self.served.get(t, 0.0) for t in competitors), default=None)
        if floor is not None:
            self.served[tenant] = floor

    def charge(self, req: Request, num_tokens: int) -> None:
        tenant = req.tenant
        self.served[tenant] = self.served.get(tenant, 0.0) + num_tokens / req.weight

    def neediest(self, tenants: Iterable[str | None]) -> str | None:
        return min(tenants, key=lambda t: self.served.get(t, 0.0))


class WaitingQueue:
    """Waiting (and preempted) requests, one list per tenant sorted by Ranking.key."""

    def __init__(self, ranking: Ranking, fair: FairShare | None, batch_priority: int) -> None:
        self.ranking = ranking
        self.fair = fair
        self.batch_priority = batch_priority
        self._queues: dict[str | None, list[Request]] = {}
        self._served_at: dict[str | None, float] = {}  # each tenant's last service
        self._size = 0
        self.num_tokens = 0  # tokens to compute before their first output: shedding
        self.num_batch = 0  # how many of the batch class wait

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __iter__(self) -> Iterator[Request]:
        """In rank order (for inspection; the scheduler uses best())."""
        everyone = [r for q in self._queues.values() for r in q]
        return iter(sorted(everyone, key=self.ranking.key))

    def tenants(self) -> set[str | None]:
        """Tenants with at least one waiting request."""
        return set(self._queues)

    def add(self, req: Request) -> None:
        queue = self._queues.get(req.tenant)
        if queue is None:
            if self.fair is not None:
                self.fair.level(req.tenant, self._queues)
            queue = self._queues[req.tenant] = []
        bisect.insort(queue, req, key=self.ranking.key)
        self._size += 1
        self.num_tokens += req.num_tokens
        self.num_batch += req.priority >= self.batch_priority

    def admitted(self, req: Request, now: float) -> None:
        self.remove(req)
        self._served_at[req.tenant] = now

    def served(self, tenants: Iterable[str | None], now: float) -> None:
        """These tenants had tokens computed this step: their queues stop aging against
        other tenants' (they age within the tenant, from each request's arrival)."""
        for tenant in tenants:
            self._served_at[tenant] = now

    def competing_class(self, req: Request, now: float) -> int:
        """`req`'s class against other tenants' requests: aged from its arrival or its
        tenant's last service, whichever is later."""
        since = max(req.arrival_time, self._served_at.get(req.tenant, req.arrival_time))
        return self.ranking.effective(req, now, since)

    def remove(self, req: Request) -> None:
        queue = self._queues[req.tenant]
        queue.remove(req)
        if not queue:
            del self._queues[req.tenant]
        self._size -= 1
        self.num_tokens -= req.num_tokens
        self.num_batch -= req.priority >= self.batch_priority

    @property
    def num_interactive(self) -> int:
        return self._size - self.num_batch

    def heads(self) -> Iterator[Request]:
        """The best-ranked request of each tenant's queue."""
        return (queue[0] for queue in self._queues.values())

    def best(self, now: float) -> Request | None:
        """The next request to admit: best effective class, then the neediest tenant of
        that class, then its earliest deadline, then its earliest arrival."""
        if not self._queues:
            return None
        effective = self.ranking.effective
        if len(self._queues) == 1:
            [queue] = self._queues.values()
        else:
            heads = [(self.competing_class(q[0], now), q) for q in self._queues.values()]
            top = min(e for e, _ in heads)
            tied = [q for e, q in heads if e == top]
            if len(tied) == 1:
                queue = tied[0]
            elif self.fair is not None:
                tenant = self.fair.neediest(q[0].tenant for q in tied)
                queue = self._queues[tenant]
            else:
                queue = min(tied, key=lambda q: _deadline_order(q[0]))
        head = queue[0]
        if len(queue) == 1:
            return head
        top = effective(head, now)
        same_class = [r for r in queue[:TIE_WINDOW] if effective(r, now) == top]
        return min(same_class, key=_deadline_order)

    def in_class(self, top: int, now: float, wanted: Callable[[Request], bool]) -> list[Request]:
        """The `wanted` requests of effective class `top` or better among the first
        EXPRESS_WINDOW of each tenant's queue (a queue is sorted by class, so its requests
        of that class come first): the least-served tenant's first, then by rank."""
        found = []
        for queue in self._queues.values():
            for req in queue[:EXPRESS_WINDOW]:
                if self.ranking.effective(req, now) > top:
                    break
                if wanted(req):
                    found.append(req)
        served = {} if self.fair is None else self.fair.served
        return sorted(found, key=lambda r: (served.get(r.tenant, 0.0), self.ranking.key(r)))

    def head(self, tenant: str | None) -> Request | None:
        queue = self._queues.get(tenant)
        return queue[0] if queue else None

    def tied_heads(self, now: float) -> list[Request]:
        """The head of each tenant's queue in the best effective class: the requests
        best() chooses among by tokens served."""
        heads = [(self.competing_class(q[0], now), q[0]) for q in self._queues.values()]
        top = min((e for e, _ in heads), default=0)
        return [head for e, head in heads if e == top]

    def least_urgent(self) -> Request | None:
        """The request to shed first: the lowest-ranked one that was never scheduled, so
        nothing of it has been streamed. Completions i > 0 go with their completion 0."""
        key = self.ranking.key
        worst: Request | None = None
        for queue in self._queues.values():
            for req in reversed(queue):  # the tail ranks lowest
                if req.fork_of is None and req.first_scheduled_time is None:
                    if worst is None or key(req) > key(worst):
                        worst = req
                    break
        return worst

    def family(self, root: Request) -> list[Request]:
        """`root` and its waiting completions i > 0."""
        return [r for r in self._queues.get(root.tenant, ()) if r is root or r.fork_of is root]


class Throughput:
    """Measured prefill throughput (an exponential moving average of tokens per second over
    prefill-dominated steps): estimates prefill times for deadlines and Retry-After."""

    def __init__(self) -> None:
        self.tokens_per_s: float | None = None

    def record(self, prefill_tokens: int, decode_tokens: int, seconds: float) -> None:
        if seconds <= 0 or prefill_tokens < max(decode_tokens, 1):
            return
        rate = prefill_tokens / seconds
        ema = self.tokens_per_s
        self.tokens_per_s = rate if ema is None else (1 - _EMA) * ema + _EMA * rate

    def seconds_for(self, num_tokens: int) -> float | None:
        rate = self.tokens_per_s
        return None if rate is None else num_tokens / rate


def deadline_feasible(
    deadline: float | None, num_tokens: int, now: float, throughput: Throughput
) -> bool:
    """False once a first token can no longer arrive by the deadline: it has passed, or
    the estimated prefill time of `num_tokens` no longer fits before it."""
    if deadline is None:
        return True
    if now >= deadline:
        return False
    needed = throughput.seconds_for(num_tokens)
    return needed is None or now + needed <= deadline


def check_capacity(
    config: EngineConfig,
    throughput: Throughput,
    queued: tuple[int, int],
    new: tuple[int, int],
) -> None:
    """Shed load: raise OverloadedError if adding `new` (requests, tokens) to the `queued`
    ones would pass max_waiting_requests or max_waiting_tokens. An empty queue always
    takes a request, so a prompt longer than max_waiting_tokens is not refused forever."""
    (queued_requests, queued_tokens), (new_requests, new_tokens) = queued, new
    if queued_requests == 0:
        return
    if queued_requests + new_requests > config.max_waiting_requests:
        reason = f"{queued_requests} requests are waiting (max_waiting_requests)"
    elif queued_tokens + new_tokens > config.max_waiting_tokens:
        reason = f"{queued_tokens} tokens are waiting (max_waiting_tokens)"
    else:
        return
    raise OverloadedError(
        f"the engine is overloaded: {reason}", retry_after(throughput, queued_tokens)
    )


def over_capacity(config: EngineConfig, queue: WaitingQueue) -> bool:
    """Past either bound, with more than one request (one alone is always taken)."""
    return len(queue) > 1 and (
        len(queue) > config.max_waiting_requests or queue.num_tokens > config.max_waiting_tokens
    )


def retry_after(throughput: Throughput, queued_tokens: int) -> float:
    """Seconds until the queued prompts have drained, between 1 and 60."""
    drain = throughput.seconds_for(queued_tokens)
    return 1.0 if drain is None else min(max(drain, 1.0), 60.0)


def pick_victim(
    running: list[Request],
    candidate: Request,
    now: float,
    queue: WaitingQueue,
    config: EngineConfig,
) -> Request | None:
    """The lowest-ranked running request that `candidate` outranks by at least
    priority_preemption_gap classes and that has not used up its preemptions. Against
    its own tenant's requests the candidate counts its age from arrival; against
    another tenant's, only from its tenant's last service (WaitingQueue.competing_class)."""
    gap = config.priority_preemption_gap
    if gap is None:
        return None
    limit = config.max_preemptions_per_request
    ranking = queue.ranking
    eligible = [r for r in running if r.num_preemptions < limit]
    if not eligible:
        return None
    victim = max(eligible, key=ranking.key)
    if victim.tenant == candidate.tenant:
        rank = ranking.effective(candidate, now)
    else:
        rank = queue.competing_class(candidate, now)
    if ranking.effective(victim, now) - rank < gap:
        return None
    return victim


def slot_share_victim(
    running: list[Request],
    candidate: Request,
    config: EngineConfig,
    recompute_s: Callable[[Request], float],
    wait_s: float,
) -> Request | None:
    """With every slot taken: the running request to preempt so that `candidate`'s
    tenant gets its weighted share of max_num_seqs. Shares are by weight among the
    tenants running and the candidate's. The candidate's tenant must stay within its
    share with one more slot and the victim's tenant within its share with one fewer (so
    two tenants never trade a slot back and forth); the victim is of no more urgent class
    than the candidate (by their priorities: a request that has run long enough to age
    holds no more of the slots than its tenant's share), has preemptions left, and is
    the cheapest such request to recompute; and only if recomputing it (`recompute_s`) is
    predicted to cost less than `wait_s`, the wait for a slot to free by itself."""
    weights: dict[str | None, int] = {candidate.tenant: candidate.weight}
    counts: dict[str | None, int] = {candidate.tenant: 0}
    for r in running:
        weights[r.tenant] = max(weights.get(r.tenant, 1), r.weight)
        counts[r.tenant] = counts.get(r.tenant, 0) + 1
    total = sum(weights.values())
    slots = len(running)

    def share(tenant: str | None) -> float:
        return slots * weights[tenant] / total

    if counts[candidate.tenant] + 1 > share(candidate.tenant):
        return None
    eligible = [
        r
        for r in running
        if r.tenant != candidate.tenant
        and counts[r.tenant] - 1 >= share(r.tenant)
        and r.num_preemptions < config.max_preemptions_per_request
        and r.priority >= candidate.priority
    ]
    if not eligible:
        return None
    victim = min(eligible, key=lambda r: (r.num_computed_tokens, -r.arrival_time))
    return victim if recompute_s(victim) < wait_s else None


def rows_to_hold(
    running: list[Request],
    waiting: WaitingQueue,
    config: EngineConfig,
    slots: int,
    is_batch: Callable[[Request], bool],
    is_newcomer: Callable[[Request], bool],
) -> set[str] | None:
    """The running requests this step holds back to fill what protected work leaves
    (backend/SCHEDULING.md, "Protected work and filler rows"): the rows of the batch
    class (`is_batch`: by effective class, so batch work that aged past the interactive
    classes is held no more) while interactive work runs or waits; and, while a newcomer
    (`is_newcomer`: a short interactive prompt before its first token) of a tenant below
    its weighted share of the `slots` waits or prefills, the rows of the tenants above
    their share. None: nothing to protect in this step."""
    batch = config.batch_priority
    interactive = waiting.num_interactive > 0
    counts: dict[str | None, int] = {}
    newcomers = [h for h in waiting.heads() if is_newcomer(h)]
    for req in running:
        counts[req.tenant] = counts.get(req.tenant, 0) + 1
        if req.priority < batch:
            interactive = True
            if is_newcomer(req):
                newcomers.append(req)
    held = None
    if interactive:
        batch_rows = {r.request_id for r in running if is_batch(r)}
        if batch_rows or waiting.num_batch:
            held = batch_rows
    if config.tenant_fairness and newcomers:
        over = _over_share_rows(running, newcomers, counts, slots)
        if over is not None:
            held = over if held is None else held | over
    return held


def over_share_rows(running: list[Request], newcomer: Request, slots: int) -> set[str]:
    """The rows a waiting `newcomer` would make filler (rows_to_hold): those of the
    tenants above their share, if its tenant is below its own; else none."""
    counts: dict[str | None, int] = {}
    for req in running:
        counts[req.tenant] = counts.get(req.tenant, 0) + 1
    return _over_share_rows(running, [newcomer], counts, slots) or set()


def _over_share_rows(
    running: list[Request],
    newcomers: list[Request],
    counts: dict[str | None, int],
    slots: int,
) -> set[str] | None:
    """The rows of tenants above their weighted share of the slots, if a newcomer's tenant
    is below its share (its newcomer counted in): shares among the tenants running and
    the newcomers'. None: no newcomer's tenant is below its share."""
    weights: dict[str | None, int] = {}
    for req in [*running, *newcomers]:
        weights[req.tenant] = max(weights.get(req.tenant, 1), req.weight)
    total = sum(weights.values())

    def share(tenant: str | None) -> float:
        return slots * weights[tenant] / total

    def below(req: Request) -> bool:
        others = counts.get(req.tenant, 0) - (req.status == RequestStatus.RUNNING)
        return others + 1 <= share(req.tenant)

    if not any(below(r) for r in newcomers):
        return None
    return {r.request_id for r in running if counts[r.tenant] > share(r.tenant)}
