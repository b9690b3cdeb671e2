"""Continuous batching with chunked prefill, prefix caching and preemption by recompute.

Every step spends a budget of max_num_batched_tokens: first one token for each running
request that is decoding, then chunks of running prefills, then new (or preempted)
requests from the waiting queue, in order, while max_num_seqs allows. A prompt longer
than what is left of the budget is split across steps. Blocks are allocated for the tokens
scheduled now; when the pool is short, the most recently admitted running request is
preempted (its blocks freed, its output kept) and recomputed later, its prefix possibly
still cached."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from backend.config import EngineConfig
from backend.engine.batch import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from backend.engine.block_manager import BlockManager
from backend.engine.request import Request, RequestStatus


@dataclass
class _Plan:
    """One step being planned: the chunks chosen so far and the budget left."""

    budget: int
    chunks: dict[str, tuple[Request, int]] = field(default_factory=dict)  # in order
    preempted: bool = False

    def add(self, req: Request, num_tokens: int) -> None:
        self.chunks[req.request_id] = (req, num_tokens)
        self.budget -= num_tokens

    def drop(self, req: Request) -> None:
        chunk = self.chunks.pop(req.request_id, None)
        if chunk is not None:
            self.budget += chunk[1]


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_ids: list[str] = []
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def schedule(self) -> SchedulerOutput:
        plan = _Plan(self.config.max_num_batched_tokens)
        # Decodes first, so a long prompt's chunks never hold back token streams.
        for decoding in (True, False):
            for req in list(self.running):  # a copy: preemption shrinks self.running
                left = req.num_tokens - req.num_computed_tokens
                if req.status == RequestStatus.RUNNING and (left == 1) == decoding:
                    if plan.budget == 0:
                        break
                    self._schedule_running(req, min(left, plan.budget), plan)
        # A step that had to preempt admits nobody: the pool is already short. No more
        # requests run than the budget has tokens, so every decode gets a token each step.
        cfg = self.config
        max_running = min(cfg.max_num_seqs, cfg.max_num_batched_tokens)
        while not plan.preempted and plan.budget > 0 and self.waiting:
            if len(self.running) >= max_running or not self._admit(plan):
                break  # strict FIFO: the head is not overtaken
        return self._output(plan)

    def update_from_output(
        self, scheduled: SchedulerOutput, output: ModelRunnerOutput
    ) -> list[tuple[Request, int]]:
        """Advance progress, register newly full blocks in the prefix cache and append
        sampled tokens. Requests finished (aborted) since the step was scheduled are
        skipped: their tokens are dropped."""
        new_tokens: list[tuple[Request, int]] = []
        for item in scheduled.requests:
            req = self.requests.get(item.request_id)
            if req is None:
                continue
            req.num_computed_tokens += len(item.token_ids)
            self.block_manager.cache_blocks(req)
            token = output.sampled.get(item.request_id)
            if token is not None:
                req.output_token_ids.append(token)
                new_tokens.append((req, token))
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
        """Allocate for `num_new` more tokens, preempting from the back of the running list
        (the most recently admitted) until the pool has room or `req` itself is preempted.
        None from the allocator means exactly this: preempt."""
        target = req.num_computed_tokens + num_new
        while self.block_manager.allocate_slots(req.request_id, target) is None:
            victim = self.running[-1]
            self._preempt(victim)
            plan.drop(victim)  # it may have been scheduled earlier in this step
            plan.preempted = True
            if victim is req:
                return
        plan.add(req, num_new)

    def _admit(self, plan: _Plan) -> bool:
        req = self.waiting[0]
        if not self._fork_ready(req):
            return False
        computed = self._computed_blocks(req)
        bm = self.block_manager
        num_computed = len(computed) * bm.block_size
        num_new = min(req.num_tokens - num_computed, plan.budget)
        if bm.allocate_slots(req.request_id, num_computed + num_new, computed) is None:
            return False
        self.waiting.popleft()
        if bm.enable_caching:
            self.prefix_cache_queries += req.num_tokens
            self.prefix_cache_hits += num_computed
        if req.num_cached_tokens is None:
            req.num_cached_tokens = num_computed
            req.first_scheduled_time = time.monotonic()
        req.num_computed_tokens = num_computed
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        plan.add(req, num_new)
        return True

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
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)  # victims leave from the back, so order is kept

    def _output(self, plan: _Plan) -> SchedulerOutput:
        scheduled: list[ScheduledRequest] = []
        prefill = decode = 0
        for req, num_new in plan.chunks.values():
            start = req.num_computed_tokens
            if num_new == 1 and start >= req.num_prompt_tokens and start + 1 == req.num_tokens:
                decode += 1
            else:
                prefill += num_new
            scheduled.append(
                ScheduledRequest(
                    request_id=req.request_id,
                    token_ids=req.token_ids(start, start + num_new),
                    start_pos=start,
                    block_ids=list(self.block_manager.block_ids(req.request_id)),
                    params=req.params,
                    sample=start + num_new == req.num_tokens,
                    prompt_token_ids=req.prompt_token_ids,
                    output_token_ids=req.output_token_ids,
                )
            )
        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(scheduled, finished, prefill, decode)
