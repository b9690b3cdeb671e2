"""Continuous batching with chunked prefill, prefix caching and preemption by recompute;
the policy (who goes first, who is preempted, who is shed) lives in policy.py and is
described in backend/SCHEDULING.md.

Every step spends a budget of at most max_num_batched_tokens, sized from the step-cost
fit (step_cost.py) to keep the step within the latency targets in play: first one token
for each running request that is decoding, then (the express lane) short interactive
prompts ahead of long prefills and the floor for the best-ranked running prefill, then
chunks of running prefills (each capped by the long-prefill
threshold, and leaving the prefill reserve to newcomers while anyone waits), then new (or
preempted) requests from the waiting queue in policy order while max_num_seqs allows;
finally what is left of the budget tops up the chunks that were capped. A prompt longer
than its share is split across steps. Blocks are allocated for the tokens scheduled now;
when the pool is short, the lowest-ranked running request is preempted (its blocks freed,
its output kept) and recomputed later, its prefix possibly still cached. A waiting request
that outranks a running one by priority_preemption_gap classes preempts it when no slot,
budget or block is free."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from backend.config import EngineConfig
from backend.engine.batch import (
    PLACEHOLDER,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from backend.engine.block_manager import BlockManager
from backend.engine.policy import (
    FairShare,
    Ranking,
    Throughput,
    WaitingQueue,
    check_capacity,
    deadline_feasible,
    over_capacity,
    over_share_rows,
    pick_victim,
    retry_after,
    rows_to_hold,
    slot_share_victim,
)
from backend.engine.request import Request, RequestStatus
from backend.engine.step_cost import StepCostModel, StepShape
from backend.errors import (
    DeadlineExceededError,
    OverloadedError,
    RequestFailedError,
    UnknownAdapterError,
)

if TYPE_CHECKING:  # torch-free at import: the gateway imports the scheduler's types
    from backend.engine.lora import AdapterSlots
    from backend.requests import LoRARequest

# An express prompt's first chunk may stretch its step to this multiple of the step's
# time limit: its TTFT against one longer gap for the streams beside it.
EXPRESS_STRETCH = 2.0
# Drafts run where the fit predicts at least this much more tokens per second: a gain
# within its error is no gain, and a batch's last request sets when its slot frees.
DRAFT_MARGIN = 1.1


@dataclass
class _Plan:
    """One step being planned: the chunks chosen so far and the budget left. `budget` is
    what the step may still spend (the adaptive budget, once sized); `hard` what
    max_num_batched_tokens still allows, which the budget never passes."""

    budget: int
    hard: int = 0
    chunks: dict[str, tuple[Request, int]] = field(default_factory=dict)  # in order
    preempted: bool = False  # for KV blocks: the pool is short, admit nobody
    outranked: bool = False  # a waiting request preempted a running one
    capped: list[Request] = field(default_factory=list)  # prefills left unfinished

    def __post_init__(self) -> None:
        self.hard = self.hard or self.budget

    def add(self, req: Request, num_tokens: int) -> None:
        self.chunks[req.request_id] = (req, num_tokens)
        self.budget -= num_tokens
        self.hard -= num_tokens
        if num_tokens > 1 and req.num_computed_tokens + num_tokens < req.num_tokens:
            self.capped.append(req)  # a prefill chunk: the top-up may extend it

    def extend(self, req: Request, num_tokens: int) -> None:
        _, scheduled = self.chunks[req.request_id]
        self.chunks[req.request_id] = (req, scheduled + num_tokens)  # keeps its place
        self.budget -= num_tokens
        self.hard -= num_tokens

    def drop(self, req: Request) -> None:
        chunk = self.chunks.pop(req.request_id, None)
        if chunk is not None:
            self.budget += chunk[1]
            self.hard += chunk[1]


def _remaining(item: tuple[int, Request]) -> int:
    return item[0]


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.clock = clock  # the simulator's virtual clock replaces time.monotonic
        self.ranking = Ranking(config.aging_interval_s)
        self.fair = FairShare() if config.tenant_fairness else None  # tokens served per tenant
        self.waiting = WaitingQueue(self.ranking, self.fair, config.batch_priority)
        self.throughput = Throughput()
        self.step_cost = StepCostModel()  # fitted from observe_step; sizes step budgets
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []
        self.rejected: list[Request] = []  # finished by the policy; the engine drains it
        self._least_urgent: Request | None = None  # whom a full queue would shed first
        self._finished_ids: list[str] = []
        self._max_running = min(
            config.seqs_limit, config.max_num_batched_tokens - config.prefill_reserve_tokens
        )
        self._seen_at: dict[bool, float] = {}  # when each class (batch or not) was last seen
        self.step_limit_s: float | None = None  # the last step's time target, if any
        self.protecting = False  # the last step held rows back for protected work
        self.step_prefill_budget = 0  # the last step's budget after decodes
        self._express_budget = 0  # prefill tokens a step with an express prompt may take
        self.num_preemptions = 0
        self.num_priority_preemptions = 0
        self.num_slot_share_preemptions = 0
        # Rejections, counted by two threads: check_admission runs in the caller's (under
        # the engine's lock), everything else in the step thread. A shared `+= 1` from
        # both could lose counts, so each thread writes only its own; the totals add up.
        self._refused_overloaded = self._refused_deadline = 0  # the caller's thread
        self._shed_overloaded = self._expired_deadline = 0  # the step thread
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.weigh_drafts = True  # False: every proposed draft runs (tests of acceptance)
        self.adapters: AdapterSlots | None = None  # LoRA slots (set by the engine)
        self.adapters_in_use: tuple[list[str], list[str]] = ([], [])  # running, waiting
        self._draining: LoRARequest | None = None  # takes no new request (see _park)

    def check_admission(
        self,
        prompt_tokens: int,
        deadline: float | None,
        priority: int,
        copies: int = 1,
        pending: tuple[int, int] = (0, 0),
    ) -> None:
        """Before queueing `copies` completions of a prompt (with `pending` = requests and
        tokens accepted but not yet added): raise OverloadedError if the waiting queue
        cannot take them, DeadlineExceededError if the first token cannot come in time.
        Runs in the caller's thread: it reads the queue's size and a snapshot, never the
        queue itself."""
        waiting = self.waiting
        queued = (len(waiting) + pending[0], waiting.num_tokens + pending[1])
        now = self.clock()
        try:
            check_capacity(self.config, self.throughput, queued, (copies, prompt_tokens * copies))
        except OverloadedError:
            if not self._displaces(priority, now):
                self._refused_overloaded += 1
                raise
        if self.config.reject_infeasible_deadlines and not deadline_feasible(
            deadline, prompt_tokens, now, self.throughput
        ):
            self._refused_deadline += 1
            raise DeadlineExceededError("the first token cannot be produced by the deadline")

    def _displaces(self, priority: int, now: float) -> bool:
        """A request of a strictly more urgent class than the least urgent waiting one
        takes its place in a full queue (add_request then sheds that one)."""
        victim = self._least_urgent  # a snapshot: add_request decides for real
        if not self.config.shed_least_urgent_first or victim is None:
            return False
        return priority < self.ranking.effective(victim, now)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        self.requests[request.request_id] = request
        self._seen_at[self._is_batch(request)] = self.clock()
        self.waiting.add(request)
        if self.config.shed_least_urgent_first:
            self._shed_excess()
        self._note_least_urgent()

    def _note_least_urgent(self) -> None:
        """The snapshot _displaces reads. Looking it up costs a look per tenant, so it is
        kept only while the queue is at least half full: below that nobody is shed."""
        cfg, waiting = self.config, self.waiting
        half_full = (
            2 * len(waiting) >= cfg.max_waiting_requests
            or 2 * waiting.num_tokens >= cfg.max_waiting_tokens
        )
        worth = cfg.shed_least_urgent_first and half_full
        self._least_urgent = waiting.least_urgent() if worth else None

    def _shed_excess(self) -> None:
        """Back within the queue's bounds by shedding the least urgent requests not yet
        scheduled (with their other completions); the bounds may be passed only by a more
        urgent request displacing them, or by preempted requests returning."""
        waiting = self.waiting
        while over_capacity(self.config, waiting):
            victim = waiting.least_urgent()
            if victim is None:
                return
            after = retry_after(self.throughput, waiting.num_tokens)
            for req in waiting.family(victim):
                self._reject(req, OverloadedError.kind, after)
            self._shed_overloaded += 1

    @property
    def num_rejected_overloaded(self) -> int:
        """Shed: refused at submission, or displaced by a more urgent request."""
        return self._refused_overloaded + self._shed_overloaded

    @property
    def num_rejected_deadline(self) -> int:
        """deadline_exceeded: at submission, or while waiting."""
        return self._refused_deadline + self._expired_deadline

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def num_interactive(self) -> int:
        """Requests below the batch class running or waiting (read from other threads:
        the running list is copied, a count may lag a step)."""
        running = sum(not self._is_batch(req) for req in list(self.running))
        return running + max(0, self.waiting.num_interactive)

    def record_step(self, prefill_tokens: int, decode_tokens: int, seconds: float) -> None:
        """How long the last step took: the throughput behind deadline estimates."""
        self.throughput.record(prefill_tokens, decode_tokens, seconds)

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """How long a scheduled step took, start to finish: the step-cost fit."""
        self.step_cost.observe(StepShape.of(out), seconds)

    def take_rejected(self) -> list[Request]:
        rejected, self.rejected = self.rejected, []
        return rejected

    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        now = self.clock()
        plan = _Plan(cfg.max_num_batched_tokens)
        # Rows held back go last, in what the protected work leaves of the step.
        held = self._rows_to_hold(now)
        self.protecting = held is not None
        filler: list[Request] = []
        # Decodes first, so a long prompt's chunks never hold back token streams.
        prefills: list[tuple[int, Request]] = []
        decoding: set[bool] = set()  # the classes (batch or not) with a token stream
        drafting: list[Request] = []  # decode rows with draft tokens proposed
        for req in list(self.running):  # a copy: preemption shrinks self.running
            self._seen_at[self._is_batch(req)] = now
            if held and req.request_id in held:
                filler.append(req)
                continue
            left = req.num_tokens - req.num_computed_tokens
            if left > 1:
                prefills.append((left, req))
            elif req.status == RequestStatus.RUNNING and plan.budget > 0:
                if _ends_with_pending_token(req):
                    continue  # async scheduling: its last token, not yet seen, ends it
                self._schedule_running(req, 1, plan)
                decoding.add(self._is_batch(req))
                if req.spec_token_ids:
                    drafting.append(req)
        if drafting:
            self._add_drafts(plan, drafting)
        prefills.sort(key=_remaining)
        prefilling = bool(prefills)  # a protected prompt is being computed
        # Short interactive prompts jump ahead of prefills of no greater urgency, running
        # or waiting (backend/SCHEDULING.md); the running ones keep at least the floor.
        sizing = cfg.adaptive_step_budget and self.step_cost.ready  # ready after warm-up
        express = self._express_candidates(now) if sizing else []
        adaptive = self._size_budget(plan, prefills, decoding, express, now)
        reserve, cap = self._prefill_caps(plan.budget, adaptive)
        # A tenant short of its share of full slots takes them before prefills spend the
        # budget (and the express lane then carries its prompts on).
        if self.fair is not None and len(self.running) >= self._max_running and plan.budget > 0:
            best = self._next_waiting(now)
            if best is not None and self._fork_ready(best):
                self._take_slot_share(plan, best, now)
        express = express if adaptive else []
        started = [p for p in prefills if self._jumps(p[1])] if adaptive else []
        if express or started:
            lane = [r for _, r in started] + express
            top = min(self.ranking.effective(r, now) for r in lane)
            urgent = [p for p in prefills if self.ranking.effective(p[1], now) < top]
            urgent = [p for p in urgent if p not in started]
            self._run_prefills(urgent, plan, reserve, cap)
            rest = [p for p in prefills if p not in urgent and p not in started]
            keep = min(cfg.min_prefill_tokens_per_step, plan.hard) if rest else 0
            self._express(started, express, plan, now, keep)
            prefills = rest
            reserve = reserve if self.waiting else 0
        if adaptive and prefills:
            prefills = self._floor_to_the_oldest(prefills, plan, reserve)
        self._run_prefills(prefills, plan, reserve, cap)
        # A step that had to preempt for blocks admits nobody: the pool is already short.
        if not plan.preempted:
            self._admit_waiting(plan, now, protected_only=held is not None)
        self._top_up(plan)
        if held is not None:
            self._fill(plan, filler, prefilling, now)
        self._note_least_urgent()
        return self._output(plan, now)

    def _rows_to_hold(self, now: float) -> set[str] | None:
        """The running requests this step schedules only in what the protected work
        leaves (policy.rows_to_hold); None (nothing protected) without a fit or with
        filler_slowdown None."""
        if self.config.filler_slowdown is None or not self.step_cost.ready:
            return None
        floor = self.config.batch_priority

        def still_batch(req: Request) -> bool:
            return req.priority >= floor and self.ranking.effective(req, now) >= floor

        return rows_to_hold(
            self.running, self.waiting, self.config, self._max_running, still_batch, self._newcomer
        )

    def gives_way_to(self, req: Request) -> bool:
        """Whether a step that holds nothing back is worth abandoning for `req`, which
        arrived while it runs (Engine._run_sync): `req` would be protected work in the
        next step (an interactive newcomer beside batch rows, which are filler then; or a
        newcomer of a tenant below its share of the slots while another tenant runs above
        its own: their rows are filler then) and could start there (a slot free, or a
        slot-share victim that pays). Called by the step thread."""
        if self.config.filler_slowdown is None or not self._newcomer(req):
            return False
        if not self.step_cost.ready:
            return False
        if len(self.running) < self._max_running and self._runs_batch_rows():
            return True  # the batch lane: the step of batch rows waits for the newcomer's
        if self.fair is None or not over_share_rows(self.running, req, self._max_running):
            return False
        return len(self.running) < self._max_running or self._slot_share_victim(req) is not None

    def _runs_batch_rows(self) -> bool:
        """Rows that an interactive request makes filler: batch ones not aged past it."""
        now, floor = self.clock(), self.config.batch_priority
        return any(
            r.priority >= floor and self.ranking.effective(r, now) >= floor for r in self.running
        )

    def _newcomer(self, req: Request) -> bool:
        """A short interactive prompt before its first token (its own TTFT at stake)."""
        ttft, _ = self.config.targets_s(req.priority)
        fresh = not req.output_token_ids and not self._is_batch(req)
        return fresh and ttft is not None and self._short(req)

    def _fill(self, plan: _Plan, filler: list[Request], prefilling: bool, now: float) -> None:
        """The held rows, best-ranked first, while the step-cost fit predicts the step within
        filler_slowdown x what the protected work takes alone: decode rows, then, unless
        a protected prefill ran or waits, prefill chunks and admissions of held-back work
        (the batch class). A step with no protected work holds nothing back."""
        cost, slowdown = self.step_cost, self.config.filler_slowdown or 1.0
        shape = StepShape.of_chunks((r.num_computed_tokens, n) for r, n in plan.chunks.values())
        # A step with no protected work (it waits for a slot or blocks) has nothing to slow.
        protected = bool(plan.chunks)
        limit = slowdown * cost.predict(shape) if protected else math.inf
        prefills: list[tuple[int, Request]] = []
        for req in sorted(filler, key=self.ranking.key):
            req.spec_token_ids = []  # drafts are worth running only in protected rows
            left = req.num_tokens - req.num_computed_tokens
            if req.status != RequestStatus.RUNNING or plan.hard <= 0:
                continue
            if left > 1:
                prefills.append((left, req))
                continue
            longer = shape.plus_decode(req.num_computed_tokens)
            if _ends_with_pending_token(req) or cost.predict(longer) > limit:
                continue
            self._schedule_running(req, 1, plan)
            if req.request_id in plan.chunks:  # not preempted for blocks
                shape = longer
        chunked = any(n > 1 + len(r.spec_token_ids) for r, n in plan.chunks.values())
        waits = prefilling or chunked or self.waiting.num_interactive > 0
        if (protected and waits) or plan.preempted:
            return  # a protected prompt is computed or waits: held prompts wait too
        start = max((req.num_computed_tokens for _, req in prefills), default=0)
        plan.budget = min(plan.budget, cost.max_prefill_tokens(limit, shape, start, 0, plan.hard))
        prefills.sort(key=_remaining)
        self._run_prefills(prefills, plan, 0, self.config.long_prefill_cap)
        self._admit_waiting(plan, now)
        self._top_up(plan)

    def _is_batch(self, req: Request) -> bool:
        return req.priority >= self.config.batch_priority

    def _size_budget(
        self,
        plan: _Plan,
        prefills: list[tuple[int, Request]],
        decoding: set[bool],
        express: list[Request],
        now: float,
    ) -> bool:
        """Set the step's prefill budget from the tightest time target in play: the most
        prefill tokens that the step-cost fit predicts keep this step within it, never
        below the floor nor below what the short interactive prompts in play need per
        step to start within their TTFT target; with no target in play (or no fit yet:
        a scheduler without the engine's warm-up), all of max_num_batched_tokens is
        left. True when a target sized it."""
        limit = None
        if self.config.adaptive_step_budget and self.step_cost.ready:  # ready after warm-up
            limit = self._step_limit(decoding, now)
        self.step_limit_s = limit
        if limit is not None and plan.budget > 0:
            decodes = [(req.num_computed_tokens, n) for req, n in plan.chunks.values()]
            decode_shape = StepShape.of_chunks(decodes)
            start = max((req.num_computed_tokens for _, req in prefills), default=0)
            floor = min(self._floor(decode_shape, start), plan.budget)
            hard = plan.budget
            plan.budget = self.step_cost.max_prefill_tokens(limit, decode_shape, start, floor, hard)
            self._express_budget = plan.budget
            if self._may_stretch(prefills, express):
                self._express_budget = self.step_cost.max_prefill_tokens(
                    EXPRESS_STRETCH * limit, decode_shape, 0, floor, hard
                )
            # At most the express lane's stretch: past it the targets are out of reach
            # anyway, and the streams beside them would pay for nothing.
            drain = min(self._drain_tokens(prefills, express, limit), self._express_budget)
            plan.budget = min(hard, max(plan.budget, drain))
        self.step_prefill_budget = plan.budget
        return limit is not None

    def _floor(self, decode: StepShape, start: int) -> int:
        """min_prefill_tokens_per_step, or more where the step's fixed part (overhead and
        decode rows) is long: as many tokens as that takes, so a target too tight for the
        machine never leaves less than half of a step to prefill."""
        terms = self.step_cost.coefficients
        per_token = terms["prefill_token"] + terms["prefill_pair"] * start
        fixed = self.step_cost.predict(decode)
        even = int(fixed / per_token) if per_token > 0 else 0
        return max(self.config.min_prefill_tokens_per_step, even)

    def _may_stretch(self, prefills: list[tuple[int, Request]], express: list[Request]) -> bool:
        """Whether the express lane may stretch this step: only for the least-served
        tenant in play (by tokens per weight), so one tenant's flood of short prompts
        does not slow every step of the others' token streams for its own TTFT."""
        lane = {r.tenant for r in express} | {r.tenant for _, r in prefills if self._jumps(r)}
        if self.fair is None or not lane:
            return True
        served = self.fair.served
        least = min(served.get(t, 0.0) for t in lane | {r.tenant for r in self.running})
        return min(served.get(t, 0.0) for t in lane) <= least

    def _may_start(self, candidates: list[Request]) -> list[Request]:
        """The candidates that free slots could take, each tenant at most its weighted
        share of them: one tenant's flood must not size every step for itself."""
        free = max(0, self._max_running - len(self.running))
        weights: dict[str | None, int] = {}
        for req in candidates:
            weights[req.tenant] = max(weights.get(req.tenant, 1), req.weight)
        total = sum(weights.values())
        taken: dict[str | None, int] = {}
        chosen: list[Request] = []
        for req in candidates:
            share = math.ceil(free * weights[req.tenant] / total)
            if taken.get(req.tenant, 0) < share and len(chosen) < free:
                taken[req.tenant] = taken.get(req.tenant, 0) + 1
                chosen.append(req)
        return chosen

    def _drain_tokens(
        self, prefills: list[tuple[int, Request]], express: list[Request], limit: float
    ) -> int:
        """Prefill tokens per step of `limit` seconds that the short interactive prompts
        in play (running, or waiting in the express lane for a free slot) need to all
        start within their TTFT targets: a flood of short prompts must not be computed a
        floor at a time. Long prompts do not count: their own prefill is longer than any
        such target; nor do prompts that no slot could take this step, nor more than a
        tenant's weighted share of the free slots."""
        need = 0.0
        waiting = [(r.num_tokens - r.num_computed_tokens, r) for r in self._may_start(express)]
        for left, req in [*prefills, *waiting]:
            ttft, _ = self.config.targets_s(req.priority)
            if ttft is not None and self._short(req):
                need += left * limit / ttft
        return math.ceil(need)

    def _step_limit(self, decoding: set[bool], now: float) -> float | None:
        """The tightest step time the requests in play ask for, in seconds: a class with
        a token stream bounds the step by its inter-token target; a class present
        (running, waiting, or seen within latency_window_s) by half its TTFT target, so
        a newcomer of that class waits at most one step, then starts in the next; the
        global step_time_target_ms caps it. None: nothing latency-sensitive."""
        cfg = self.config
        limits = [] if cfg.step_time_target_ms is None else [cfg.step_time_target_ms / 1000]
        waiting = {True: self.waiting.num_batch > 0, False: self.waiting.num_interactive > 0}
        for batch in (False, True):
            ttft, itl = cfg.targets_s(cfg.batch_priority if batch else 0)
            if itl is not None and batch in decoding:
                limits.append(itl)
            seen = self._seen_at.get(batch)
            recent = seen is not None and now - seen <= cfg.latency_window_s
            if ttft is not None and (waiting[batch] or recent):
                limits.append(ttft / 2)
        return min(limits, default=None)

    def _prefill_caps(self, budget: int, adaptive: bool) -> tuple[int, int]:
        """The reserve running prefills leave to newcomers while anyone waits, and the
        most one prefill takes before the others had theirs: fixed shares of
        max_num_batched_tokens, or of the step's budget when a target sized it."""
        cfg = self.config
        if not adaptive:
            reserve = cfg.prefill_reserve_tokens
            return (reserve if self.waiting else 0, cfg.long_prefill_cap)
        reserve = int(budget * cfg.prefill_reserve_share) if self.waiting else 0
        threshold = cfg.long_prefill_token_threshold
        cap = max(1, budget // 4) if threshold is None else (threshold or budget)
        return reserve, cap

    def _run_prefills(
        self, prefills: list[tuple[int, Request]], plan: _Plan, reserve: int, cap: int
    ) -> None:
        """Running prefills, the closest to their first token first, each at most `cap`,
        leaving `reserve` to new prefills."""
        for left, req in prefills:
            if req.status == RequestStatus.RUNNING:  # not preempted earlier in this step
                room = min(left, cap, plan.budget - reserve)
                if room <= 0:
                    break
                self._schedule_running(req, room, plan)

    def _floor_to_the_oldest(
        self, prefills: list[tuple[int, Request]], plan: _Plan, reserve: int
    ) -> list[tuple[int, Request]]:
        """The best-ranked running prefill (by aging order) gets the floor first, so no
        stream of shorter prompts keeps a long one from progressing (the starvation
        bound in backend/SCHEDULING.md). Returns the prefills left to schedule."""
        running = [p for p in prefills if p[1].status == RequestStatus.RUNNING]
        if not running or plan.budget <= 0:
            return prefills
        left, oldest = min(running, key=lambda p: self.ranking.key(p[1]))
        room = max(1, plan.budget - reserve)  # newcomers keep the reserve
        self._schedule_running(
            oldest, min(left, self.config.min_prefill_tokens_per_step, room), plan
        )
        return [p for p in prefills if p[1] is not oldest]

    def _jumps(self, req: Request) -> bool:
        """An interactive request (its class has a TTFT target) with a short prompt: at
        most long_prefill_cap tokens to compute before its first token."""
        ttft, _ = self.config.targets_s(req.priority)
        return ttft is not None and self._short(req) and req.first_token_time is None

    def _short(self, req: Request) -> bool:
        """A prompt whose own work (less any prefix-cache hit) is at most
        long_prefill_cap: the tail of a long prompt is not short, its TTFT target is
        long gone (counted as short, a document flood's tails stretched steps to twice
        the inter-token target, bench/README.md issue 15)."""
        return req.num_tokens - (req.num_cached_tokens or 0) <= self.config.long_prefill_cap

    def _express_candidates(self, now: float) -> list[Request]:
        """Waiting requests that may jump: short interactive prompts in the best waiting
        request's effective class, so they overtake only requests of their own class or
        a less urgent one."""
        if not self.waiting or len(self.running) >= self._max_running:
            return []
        best = self.waiting.best(now)
        if best is None:
            return []
        return self.waiting.in_class(self.ranking.effective(best, now), now, self._jumps)

    def _express(
        self,
        started: list[tuple[int, Request]],
        candidates: list[Request],
        plan: _Plan,
        now: float,
        keep: int,
    ) -> None:
        """The express lane: short interactive prompts already started go on and the
        candidates start, the least-served tenant's first (then those started, then by
        rank), while tokens (and, to start, a slot) are left. The step may grow for them
        to what fits in EXPRESS_STRETCH x its limit (at least the floor for the first,
        never past max_num_batched_tokens), less `keep` for the other prefills; a prompt
        that does not fit goes on in the next steps, in this lane."""
        served = {} if self.fair is None else self.fair.served
        lane: list[tuple[int | None, Request]] = [*started, *((None, r) for r in candidates)]
        lane.sort(
            key=lambda i: (served.get(i[1].tenant, 0.0), i[0] is None, self.ranking.key(i[1]))
        )
        first = lane[0][1]
        least = min(
            first.num_tokens - first.num_computed_tokens, self.config.min_prefill_tokens_per_step
        )
        before, room = plan.budget, plan.hard
        plan.budget = max(plan.budget, min(max(self._express_budget, least + keep), plan.hard))
        for left, req in lane:
            if plan.budget - keep <= 0:
                break
            if left is None:
                self._express_admit(req, plan, now, plan.budget - keep)
            elif req.status == RequestStatus.RUNNING:  # not preempted meanwhile
                self._schedule_running(req, min(left, plan.budget - keep), plan)
        # The stretch was for them: the others get what was theirs, and at least `keep`.
        used = room - plan.hard
        plan.budget = min(plan.budget, max(before - used, keep))

    def _express_admit(self, req: Request, plan: _Plan, now: float, most: int) -> None:
        if len(self.running) >= self._max_running or req.status == RequestStatus.RUNNING:
            return  # no slot, or the slot share started it already
        if self.config.reject_infeasible_deadlines and not deadline_feasible(
            req.deadline, req.num_tokens, now, self.throughput
        ):
            self._reject(req, DeadlineExceededError.kind)
            self._expired_deadline += 1
        elif self._fork_ready(req):
            self._admit(req, plan, now, most)

    def _next_waiting(self, now: float) -> Request | None:
        """The best waiting request, after rejecting those whose deadline can no longer
        be met."""
        cfg = self.config
        while self.waiting:
            req = self.waiting.best(now)
            if (
                req is not None
                and cfg.reject_infeasible_deadlines
                and req.first_token_time is None
                and not deadline_feasible(req.deadline, req.num_tokens, now, self.throughput)
            ):
                self._reject(req, DeadlineExceededError.kind)
                self._expired_deadline += 1
                continue
            return req
        return None

    def update_from_output(
        self, scheduled: SchedulerOutput, output: ModelRunnerOutput
    ) -> list[tuple[Request, list[int]]]:
        """Advance progress, register newly full blocks in the prefix cache and append
        sampled tokens (one, or a verified row's accepted drafts and one more). Requests
        finished (aborted) since the step was scheduled are skipped: their tokens are
        dropped."""
        new_tokens: list[tuple[Request, list[int]]] = []
        for item in scheduled.requests:
            req = self.requests.get(item.request_id)
            if req is None:
                continue
            if item.num_drafts:
                # The last token and the accepted drafts are computed; the slots of the
                # rejected ones go back to the pool (their KV is overwritten later).
                tokens = output.verified.get(item.request_id)
                if tokens is None:
                    continue
                req.spec_token_ids = []
                req.num_computed_tokens += len(tokens)
                req.output_token_ids += tokens
                self.block_manager.trim(req.request_id, req.num_tokens)
                self.block_manager.cache_blocks(req)
                new_tokens.append((req, tokens))
                continue
            req.num_computed_tokens += len(item.token_ids)
            self.block_manager.cache_blocks(req)
            token = output.sampled.get(item.request_id)
            if token is not None:
                req.output_token_ids.append(token)
                new_tokens.append((req, [token]))
        return new_tokens

    def advance(self, scheduled: SchedulerOutput) -> list[tuple[Request, int]]:
        """Async scheduling, once a step is launched: its progress, with a PLACEHOLDER
        for each token it samples, so the next step can be scheduled before the token is
        known. Returns (request, index of its placeholder in output_token_ids) for
        `resolve`. Requests finished since the step was scheduled are skipped."""
        placed: list[tuple[Request, int]] = []
        for item in scheduled.requests:
            req = self.requests.get(item.request_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue
            req.num_computed_tokens += len(item.token_ids)
            # Every token before num_computed_tokens is known (the placeholder comes
            # after), and the step in flight writes their KV before any later step reads
            # it: the new full blocks are cached now, as after a synchronous step.
            self.block_manager.cache_blocks(req)
            if item.sample:
                req.output_token_ids.append(PLACEHOLDER)
                placed.append((req, len(req.output_token_ids) - 1))
        return placed

    def resolve(
        self, placed: list[tuple[Request, int]], output: ModelRunnerOutput
    ) -> list[tuple[Request, list[int]]]:
        """Async scheduling, once the step's tokens are read back: each placeholder
        becomes its token. Requests finished (aborted) since `advance` are skipped: their
        tokens are dropped."""
        new_tokens: list[tuple[Request, list[int]]] = []
        for req, index in placed:
            if self.requests.get(req.request_id) is not req:
                continue
            token = output.sampled[req.request_id]
            req.output_token_ids[index] = token
            new_tokens.append((req, [token]))
        return new_tokens

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        """Finish and free the given requests; unknown or already finished ids are ignored.
        Returns the requests this call finished."""
        done: list[Request] = []
        for request_id in request_ids:
            req = self.requests.pop(request_id, None)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            req.status = status
            self.block_manager.free(request_id)
            self._finished_ids.append(request_id)
            done.append(req)
        return done

    def _schedule_running(self, req: Request, num_new: int, plan: _Plan) -> None:
        """Allocate for `num_new` more tokens, preempting the lowest-ranked running request
        until the pool has room or `req` itself is preempted. None from the allocator means
        exactly this: preempt."""
        target = req.num_computed_tokens + num_new
        while self.block_manager.allocate_slots(req.request_id, target) is None:
            victim = max(self.running, key=self.ranking.key)
            self._preempt(victim)
            plan.drop(victim)  # it may have been scheduled earlier in this step
            plan.preempted = True
            if victim is req:
                return
        plan.add(req, num_new)

    def _add_drafts(self, plan: _Plan, candidates: list[Request]) -> None:
        """Extend decode rows by their draft tokens (speculative decoding), the most
        promising first, while the step-cost fit predicts more tokens per second for it:
        a row's drafts add `spec_gain` expected tokens and the time of computing them
        (on a CPU, a wide batch's drafts cost more than they bring; on a GPU a step is
        nearly flat in its tokens). Drafts never preempt: a row whose drafts the pool
        cannot hold decodes without them."""
        cost, bm = self.step_cost, self.block_manager
        shape = StepShape.of_chunks((r.num_computed_tokens, n) for r, n in plan.chunks.values())
        tokens, seconds = float(len(plan.chunks)), cost.predict(shape)
        candidates.sort(key=lambda r: r.spec_gain / len(r.spec_token_ids), reverse=True)
        for req in candidates:
            drafts, req.spec_token_ids = req.spec_token_ids[: plan.budget], []
            if not drafts or req.request_id not in plan.chunks:  # preempted since
                continue
            longer = shape.with_drafts(req.num_computed_tokens, len(drafts))
            more, longer_s = tokens + req.spec_gain, cost.predict(longer)
            if not self._drafts_pay((tokens, seconds), (more, longer_s)):
                continue
            if bm.allocate_slots(req.request_id, req.num_tokens + len(drafts)) is None:
                continue
            req.spec_token_ids = drafts
            plan.extend(req, len(drafts))
            shape, tokens, seconds = longer, more, longer_s

    def _drafts_pay(self, before: tuple[float, float], after: tuple[float, float]) -> bool:
        """Whether (expected tokens, predicted seconds) of the step with a row's drafts
        beat those without them by DRAFT_MARGIN in tokens per second (always, before the
        fit is ready or with weigh_drafts off)."""
        if not (self.weigh_drafts and self.step_cost.ready):
            return True
        (tokens, seconds), (more, longer_s) = before, after
        return more * seconds > DRAFT_MARGIN * tokens * longer_s

    def _admit_waiting(self, plan: _Plan, now: float, protected_only: bool = False) -> None:
        """Admit in policy order. A LoRA request whose adapter finds no slot is set aside
        for this step, so the requests behind it go on (no head-of-line blocking).
        `protected_only`: rows are held back this step, and the batch class waits for
        what the protected work leaves (_fill)."""
        parked: list[Request] = []
        try:
            self._admit_in_order(plan, now, parked, protected_only)
        finally:
            self._unpark(parked)

    def _admit_in_order(
        self, plan: _Plan, now: float, parked: list[Request], protected_only: bool
    ) -> None:
        """The best request is never overtaken (but by those behind a parked one). When it
        cannot start (no slot, budget or blocks), it may preempt a running request it
        outranks, or, when its tenant runs fewer than its share of the slots, one of a
        tenant running more than its share."""
        cfg = self.config
        while True:
            req = self._next_waiting(now)
            if req is None or not self._fork_ready(req):
                return
            if protected_only and self.ranking.effective(req, now) >= cfg.batch_priority:
                return  # the batch class, not aged past it
            if not self._adapter_resident(req):
                if self.requests.get(req.request_id) is req:  # not failed: it waits a slot
                    self._park(req, parked)
                continue
            slots_full = len(self.running) >= self._max_running
            if not slots_full and plan.budget > 0 and self._admit(req, plan, now):
                if plan.outranked:
                    return  # what the victims freed is spoken for
                continue
            victim = pick_victim(self.running, req, now, self.waiting, cfg)
            if victim is not None:
                self.num_priority_preemptions += 1
                plan.outranked = True
            elif slots_full and plan.budget > 0 and self.fair is not None:
                self._take_slot_share(plan, req, now)
                return
            if victim is None:
                return
            self._preempt(victim)
            plan.drop(victim)

    def _take_slot_share(self, plan: _Plan, best: Request, now: float) -> None:
        """Every slot is taken: admit, in place of running requests, the tenants that run
        fewer than their weighted share of the slots. Only among the best class: the
        heads of its tenants' queues, `best` first (fair share by tokens chose it), are
        equals, and the one that lacks slots goes first."""
        candidates = [best, *(h for h in self.waiting.tied_heads(now) if h.tenant != best.tenant)]
        for candidate in candidates:
            req: Request | None = candidate
            while req is not None and self._fork_ready(req) and plan.budget > 0:
                victim = self._slot_share_victim(req)
                if victim is None:
                    break
                self._preempt(victim)
                plan.drop(victim)
                self.num_slot_share_preemptions += 1
                if not self._admit(req, plan, now):
                    return
                req = self.waiting.head(req.tenant)  # its next, while it lacks slots

    def _slot_share_victim(self, req: Request) -> Request | None:
        """max_num_seqs is full: the running request to preempt so that `req`'s tenant
        gets its weighted share of the slots, if recomputing it is predicted to cost less
        than waiting for the first running request to finish (policy.slot_share_victim).
        Recomputing is the tokens past its blocks in the prefix cache: preemption frees
        them there, and its readmission finds them (unless the pool evicts them first)."""
        if not self.step_cost.ready:
            return None
        rows = [(r.num_computed_tokens, 1) for r in self.running]
        step_s = self.step_cost.step_time(rows)
        soonest = min(r.max_len - r.num_computed_tokens for r in self.running)
        cost, blocks = self.step_cost, self.block_manager

        def recompute_s(victim: Request) -> float:
            n = victim.num_computed_tokens
            kept = max(0, min(blocks.num_cached_tokens(victim.request_id), n - 1))
            tail = StepShape().plus_prefill(kept, n - kept)
            return cost.predict(tail) - cost.predict(StepShape())

        return slot_share_victim(self.running, req, self.config, recompute_s, soonest * step_s)

    def _admit(self, req: Request, plan: _Plan, now: float, most: int | None = None) -> bool:
        """Start `req` with a first chunk of at most `most` tokens (default: the budget
        left, capped by the long-prefill threshold)."""
        if not self._adapter_resident(req):
            return False
        computed = self._computed_blocks(req)
        bm = self.block_manager
        num_computed = len(computed) * bm.block_size
        most = min(plan.budget, self.config.long_prefill_cap) if most is None else most
        num_new = min(req.num_tokens - num_computed, most)
        if bm.allocate_slots(req.request_id, num_computed + num_new, computed) is None:
            return False
        self.waiting.admitted(req, now)
        if bm.enable_caching:
            self.prefix_cache_queries += req.num_tokens
            self.prefix_cache_hits += num_computed
        if req.num_cached_tokens is None:
            req.num_cached_tokens = num_computed
            req.first_scheduled_time = now
        req.num_computed_tokens = num_computed
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        plan.add(req, num_new)
        return True

    def _adapter_resident(self, req: Request) -> bool:
        """Its LoRA adapter is on the device, loaded now if a slot is free or holds one
        that no running request uses (the least recently used of those). The adapter
        being drained for a parked request starts no new request."""
        lora = req.caller.lora
        if lora is None or self.adapters is None:
            return True
        if lora == self._draining:
            return False
        in_use = {r.caller.lora for r in self.running if r.caller.lora is not None}
        try:
            return self.adapters.make_resident(lora, in_use)
        except UnknownAdapterError:
            self._reject(req, RequestFailedError.kind)  # it fails; the engine goes on
            return False

    def _park(self, req: Request, parked: list[Request]) -> None:
        """Out of the queue for this step. So that requests on the resident adapters
        cannot keep every slot busy forever, the one with the fewest running requests
        (the least recently used of those) takes no new request until it is idle and a
        parked request can take its slot."""
        self.waiting.remove(req)
        parked.append(req)
        resident = self.adapters.resident if self.adapters is not None else {}
        if self._draining is None or self._draining not in resident:
            running = [r.caller.lora for r in self.running]
            self._draining = min(resident, key=running.count, default=None)

    def _unpark(self, parked: list[Request]) -> None:
        """Parked requests back in the queue, in their places; a tenant's fair-share
        account unchanged by its queue having been empty for a moment."""
        if not parked:
            self._draining = None
            return
        served = {} if self.fair is None else dict(self.fair.served)
        for req in parked:
            self.waiting.add(req)
            if req.tenant in served and self.fair is not None:
                self.fair.served[req.tenant] = served[req.tenant]

    def _note_adapters(self) -> None:
        """The adapters of running and of waiting requests, by name, as of this step (for
        metrics: read from other threads, so replaced whole, never mutated)."""
        running = {r.caller.lora.name for r in self.running if r.caller.lora is not None}
        waiting = {r.caller.lora.name for r in self.waiting if r.caller.lora is not None}
        self.adapters_in_use = (sorted(running), sorted(waiting))

    def _top_up(self, plan: _Plan) -> None:
        """Give what is left of the budget to prefills that were capped, the closest to
        their first token first, so the caps shape who goes first without leaving tokens
        unused."""
        if plan.budget == 0 or not plan.capped:
            return
        unfinished = []
        for req in plan.capped:
            chunk = plan.chunks.get(req.request_id)
            if chunk is not None:  # not preempted since
                unfinished.append((req.num_tokens - req.num_computed_tokens - chunk[1], req))
        unfinished.sort(key=_remaining)
        for left, req in unfinished:
            if plan.budget == 0:
                return
            extra = min(left, plan.budget)
            end = req.num_tokens - left + extra
            if self.block_manager.allocate_slots(req.request_id, end) is not None:
                plan.extend(req, extra)

    def _reject(self, req: Request, reason: str, retry_after_s: float | None = None) -> None:
        self.finish_requests([req.request_id], RequestStatus.FINISHED_REJECTED)
        req.rejection = reason
        req.retry_after_s = retry_after_s
        self.rejected.append(req)

    def _fork_ready(self, req: Request) -> bool:
        """Completion i > 0 of an n > 1 request waits until completion 0 has computed the
        prompt's full blocks, then shares them instead of computing the prompt again."""
        parent = req.fork_of
        if parent is None or req.output_token_ids or parent.is_finished:
            return True
        bs = self.block_manager.block_size
        return parent.num_computed_tokens >= (req.num_prompt_tokens - 1) // bs * bs

    def _computed_blocks(self, req: Request) -> list[int]:
        """Blocks whose KV is already known: prefix-cache hits, or (with the cache off) the
        full prompt blocks of the sibling this completion was forked from."""
        parent = req.fork_of
        if self.block_manager.enable_caching or parent is None:
            return self.block_manager.get_computed_blocks(req)
        if parent.status != RequestStatus.RUNNING:
            return []
        bs = self.block_manager.block_size
        n = min(req.num_prompt_tokens, parent.num_computed_tokens, req.num_tokens - 1) // bs
        return self.block_manager.block_ids(parent.request_id)[:n]

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.block_manager.free(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add(req)  # by its arrival: it keeps its age and its place

    def _output(self, plan: _Plan, now: float) -> SchedulerOutput:
        if self.adapters is not None:
            self._note_adapters()
        self.waiting.served({req.tenant for req, _ in plan.chunks.values()}, now)
        scheduled: list[ScheduledRequest] = []
        prefill = decode = 0
        charge = None if self.fair is None else self.fair.charge
        for req, num_new in plan.chunks.values():
            if charge is not None:
                charge(req, num_new)
            start = req.num_computed_tokens
            drafts = req.spec_token_ids if start + 1 == req.num_tokens else []
            num_real = num_new - len(drafts)
            if num_real == 1 and start >= req.num_prompt_tokens and start + 1 == req.num_tokens:
                decode += num_new
            else:
                prefill += num_new
                req.num_prefill_chunks += 1
            scheduled.append(
                ScheduledRequest(
                    request_id=req.request_id,
                    token_ids=req.token_ids(start, start + num_real) + drafts,
                    start_pos=start,
                    block_ids=list(self.block_manager.block_ids(req.request_id)),
                    params=req.params,
                    sample=start + num_real == req.num_tokens,
                    prompt_token_ids=req.prompt_token_ids,
                    output_token_ids=req.output_token_ids,
                    matcher=req.matcher,
                    num_drafts=len(drafts),
                    lora_slot=-1 if self.adapters is None else self.adapters.slot(req.caller.lora),
                    num_preemptions=req.num_preemptions,
                )
            )
        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(scheduled, finished, prefill, decode)


def _ends_with_pending_token(req: Request) -> bool:
    """Its newest output token, still a PLACEHOLDER, reaches max_tokens or max_len: the
    request finishes when that token is seen, so a further step would be wasted (and
    could take a block from the pool). Never true after a synchronous step: such a
    request is already finished."""
    return len(req.output_token_ids) >= req.params.max_tokens or req.num_tokens >= req.max_len
