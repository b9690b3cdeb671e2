"""The two small dataclasses that cross the scheduler / model runner seam each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from backend.sampling import SamplingParams


@dataclass(frozen=True)
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # the tokens to compute this step
    start_pos: int  # == the request's num_computed_tokens before this step
    block_ids: list[int]  # the request's whole block table
    params: SamplingParams
    sample: bool  # False for a prefill chunk that does not reach the prompt's end


@dataclass(frozen=True)
class SchedulerOutput:
    requests: list[ScheduledRequest]
    # Requests that left since the last step, so the runner can drop their state.
    finished_request_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.requests)


@dataclass(frozen=True)
class ModelRunnerOutput:
    sampled: dict[str, int]  # request id -> new token, for requests with sample=True
