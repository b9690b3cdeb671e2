"""A request's state inside the engine. Progress has one measure: num_computed_tokens
catches up with num_tokens (prompt + output); prefill, decode and recompute after a
preemption are not separate modes."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from backend.requests import EngineRequest
from backend.sampling import SamplingParams

if TYPE_CHECKING:
    from backend.grammar import GrammarMatcher


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # back in the waiting queue, its output kept, its KV to be recomputed
    # Everything from here on is finished; is_finished compares against this.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_REJECTED = 6  # by the policy (deadline_exceeded, overloaded): Request.rejection
    FINISHED_FAILED = 7  # a fault while stepping it (request_failed); the engine goes on

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_REJECTED: "rejected",
    RequestStatus.FINISHED_FAILED: "error",
}


@dataclass(eq=False)  # identity equality: list.remove must find this very request
class Request:
    """One completion in the scheduler. `caller` is the request as it was asked, whole:
    its id, tenant, weight, priority and deadline are read from it. `request_id` is the
    engine's key: completion `index` of an n > 1 request is its own Request (key
    `caller.request_id + "\\0" + index` for index >= 1, `params` drawing with its own seed)
    that shares the prompt's blocks of `fork_of`, the completion with index 0."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_len: int  # prompt + output never exceed this (max_tokens capped by max_model_len)
    caller: EngineRequest
    cache_salt: str | None = None  # part of every block hash: no sharing across salts
    index: int = 0
    fork_of: Request | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None  # prefix-cache hit at first admission
    num_preemptions: int = 0
    num_prefill_chunks: int = 0  # steps that computed part of its prompt (or recomputed)
    block_hashes: list[bytes] = field(default_factory=list)  # chained, one per full block
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    rejection: str | None = None  # why the policy finished it ("deadline_exceeded", ...)
    retry_after_s: float | None = None  # with "overloaded": when the queue should have room
    matcher: GrammarMatcher | None = None  # with a constraint: its place in the grammar
    # Draft tokens to verify in its next decode step (backend/engine/speculative.py);
    # -1s are placeholders the draft model fills in the step itself.
    spec_token_ids: list[int] = field(default_factory=list)
    spec_gain: float = 0.0  # drafts it is expected to get accepted (acceptance x drafts)

    @property
    def external_id(self) -> str:
        """The caller's id (its completions' keys add their index)."""
        return self.caller.request_id

    @property
    def tenant(self) -> str | None:
        return self.caller.tenant

    @property
    def weight(self) -> int:
        return self.caller.weight

    @property
    def priority(self) -> int:
        return self.caller.priority

    @property
    def deadline(self) -> float | None:
        return self.caller.deadline

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without copying the whole history."""
        prompt_len = len(self.prompt_token_ids)
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len : end - prompt_len]
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - prompt_len]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished


def fan_out(
    caller: EngineRequest,
    prompt_token_ids: list[int],
    max_len: int,
    *,
    cache_salt: str | None = None,
    arrival_time: float | None = None,
) -> list[Request]:
    """The params.n completions of the caller's request: index 0 keeps its id; index i
    draws with seed + i and is forked from index 0 (shares its prompt blocks)."""
    reqs: list[Request] = []
    arrival = time.monotonic() if arrival_time is None else arrival_time
    params = caller.params
    for i in range(params.n):
        seed = params.seed
        reqs.append(
            Request(
                caller.request_id if i == 0 else f"{caller.request_id}\0{i}",
                prompt_token_ids,
                # One draw each: seed + i is valid for n = 1 wherever seed was for n.
                params if i == 0 or seed is None else replace(params, seed=seed + i, n=1),
                max_len,
                caller,
                cache_salt=cache_salt,
                index=i,
                fork_of=reqs[0] if reqs else None,
                arrival_time=arrival,
            )
        )
    return reqs
