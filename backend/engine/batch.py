"""The small dataclasses that cross the scheduler / model runner seam each step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from backend.outputs import TokenLogprobs
from backend.sampling import SamplingParams

if TYPE_CHECKING:
    from backend.grammar import GrammarMatcher


# An input or output token id not known on the host yet: the previous step's sampled
# token, still on the device (async scheduling). The model runner fills it in on the
# device before the forward pass; the engine replaces it once the step is read back.
PLACEHOLDER = -1


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # the tokens to compute this step
    start_pos: int  # == the request's num_computed_tokens before this step
    block_ids: list[int]  # the request's whole block table
    params: SamplingParams
    sample: bool  # False for a chunk that does not reach the request's last token
    # The request's own lists, not copies: penalties and min_tokens read its history.
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    matcher: GrammarMatcher | None = None  # a constrained request's: the sampler masks its row
    # The last num_drafts of token_ids are draft tokens to verify (speculative decoding):
    # the row samples at each of its last num_drafts + 1 positions.
    num_drafts: int = 0
    lora_slot: int = -1  # the LoRA adapter's device slot (backend/engine/lora.py); -1: none
    # How often the request was preempted: its KV (a draft model's too) was freed each time.
    num_preemptions: int = 0


@dataclass(frozen=True)
class SchedulerOutput:
    requests: list[ScheduledRequest]
    # Requests that left since the last step, so the runner can drop their state.
    finished_request_ids: list[str] = field(default_factory=list)
    num_prefill_tokens: int = 0  # prompt chunks and recomputation after preemption
    num_decode_tokens: int = 0  # one per request generating its next token

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


@dataclass(frozen=True)
class ModelRunnerOutput:
    sampled: dict[str, int]  # request id -> new token, for requests with sample=True
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)  # those that asked
    # Rows with draft tokens (instead of `sampled`): the accepted drafts, then one token.
    verified: dict[str, list[int]] = field(default_factory=dict)
