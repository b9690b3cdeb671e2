"""Continuous batching. Every step: running requests first (one decode token each), then
waiting prompts while the token budget, max_num_seqs and the KV pool allow.

Until preemption exists, a prompt is admitted only when the pool can also hold the
worst-case growth (up to max_len) of everything already running, so a decode step can
never run out of blocks."""

from __future__ import annotations

import time
from collections import deque

from backend.config import EngineConfig
from backend.engine.batch import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from backend.engine.block_manager import BlockManager
from backend.engine.request import Request, RequestStatus


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_ids: list[str] = []

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        for req in self.running:
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if num_new <= 0 or not self._allocate(req, num_new):
                continue  # cannot happen while admission reserves max_len; preemption goes here
            scheduled.append(self._scheduled(req, num_new))
            budget -= num_new
        reserve = sum(self._future_blocks(r) for r in self.running)
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            num_new = req.num_tokens - req.num_computed_tokens
            free_after = self.block_manager.num_free_blocks - reserve
            if num_new > budget or self._future_blocks(req) > free_after:
                break  # strict FIFO: a large head prompt is not overtaken
            if not self._allocate(req, num_new):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            req.first_scheduled_time = time.monotonic()
            self.running.append(req)
            scheduled.append(self._scheduled(req, num_new))
            budget -= num_new
            reserve += self._future_blocks(req)
        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(scheduled, finished)

    def update_from_output(
        self, scheduled: SchedulerOutput, output: ModelRunnerOutput
    ) -> list[tuple[Request, int]]:
        """Advance progress and append sampled tokens. Requests finished (aborted) since the
        step was scheduled are skipped: their tokens are dropped."""
        new_tokens: list[tuple[Request, int]] = []
        for item in scheduled.requests:
            req = self.requests.get(item.request_id)
            if req is None:
                continue
            req.num_computed_tokens += len(item.token_ids)
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
            if req.status == RequestStatus.WAITING:
                self.waiting.remove(req)
            else:
                self.running.remove(req)
            req.status = status
            self.block_manager.free(request_id)
            self._finished_ids.append(request_id)
            done.append(req)
        return done

    def _allocate(self, req: Request, num_new: int) -> bool:
        slots = req.num_computed_tokens + num_new
        return self.block_manager.allocate_slots(req.request_id, slots) is not None

    def _future_blocks(self, req: Request) -> int:
        """Blocks the request may still need to reach max_len."""
        have = len(self.block_manager.block_ids(req.request_id))
        return max(self.block_manager.blocks_for(req.max_len) - have, 0)

    def _scheduled(self, req: Request, num_new: int) -> ScheduledRequest:
        start = req.num_computed_tokens
        return ScheduledRequest(
            request_id=req.request_id,
            token_ids=req.token_ids(start, start + num_new),
            start_pos=start,
            block_ids=list(self.block_manager.block_ids(req.request_id)),
            params=req.params,
            sample=start + num_new == req.num_tokens,
        )
