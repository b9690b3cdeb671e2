"""What the engine hands back: one RequestOutput per request per step, and stats."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities of one generated token under the model's raw distribution (before
    temperature, top-k and top-p). `top` holds the `SamplingParams.logprobs` most likely
    tokens as (token id, logprob), best first; it may or may not include `token_id`."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: list[tuple[int, float]]


@dataclass
class RequestOutput:
    """A delta: `text` and `token_ids` are new since the previous output of this request.
    Times are time.monotonic() seconds. With SamplingParams.n > 1 each output belongs to
    completion `index`; `finished` refers to that completion."""

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"; None until finished
    prompt_tokens: int
    completion_tokens: int  # cumulative, for this completion
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None  # queue time = this - arrival_time
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per id in token_ids
    index: int = 0  # which of the n completions
    prefill_chunks: int = 0  # steps so far that computed part of its prompt
    logprobs: list[TokenLogprobs] | None = None  # one per id in token_ids, if requested
    # An OpenAI-compatible upstream's tool-call deltas, in OpenAI's streamed shape
    # (`delta.tool_calls`). Tollgate's engine leaves it None: the gateway parses its text.
    tool_calls: list[dict[str, Any]] | None = None
    # And its logprobs of this delta, in OpenAI's shape for the endpoint (chat's
    # {"content": [...]}, completions' {"tokens", "token_logprobs", ...}).
    relayed_logprobs: dict[str, Any] | None = None
    # Set on the final output of a request the policy rejected after queueing it
    # (finish_reason "rejected"): "deadline_exceeded", or "overloaded" when a more urgent
    # request took its place in a full queue. AsyncEngine raises it instead.
    error: str | None = None
    retry_after_s: float | None = None  # with "overloaded"

    def then(self, later: RequestOutput) -> RequestOutput:
        """This delta and the `later` one of the same completion as one delta, as if the
        engine had produced both runs of tokens in one step."""
        logprobs = None
        if self.logprobs is not None and later.logprobs is not None:
            logprobs = self.logprobs + later.logprobs
        return replace(
            later,
            text=self.text + later.text,
            token_ids=self.token_ids + later.token_ids,
            token_times=self.token_times + later.token_times,
            logprobs=logprobs,
            first_scheduled_time=self.first_scheduled_time or later.first_scheduled_time,
            first_token_time=self.first_token_time or later.first_token_time,
        )


def coalesced(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """One delta per completion for a request's `outputs` (in order of each completion's
    first delta): what a consumer that waited for them all receives in one wake-up
    instead of one per token. Unchanged if one is an error (it ends the request)."""
    if any(out.error is not None for out in outputs):
        return outputs
    merged: dict[int, RequestOutput] = {}
    for out in outputs:
        last = merged.get(out.index)
        merged[out.index] = out if last is None else last.then(out)
    return list(merged.values())


@dataclass(frozen=True)
class EngineStats:
    """A snapshot. Every KV block is exactly one of used (referenced by a request), cached
    (free, but holding a prefix that a later request may reuse; evicted LRU-first) or free.
    `step_*` describe the last step; `total_*` and the counters are cumulative."""

    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_free: int
    block_size: int
    num_steps: int
    num_interactive: int = 0  # of those running or waiting, below the batch class
    busy_s: float = 0.0  # seconds spent stepping, cumulative (the busy share of the clock)
    batch_busy_s: float = 0.0  # of those, the batch class's: a step's by its rows' tokens
    kv_blocks_cached: int = 0
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache at admission
    prefix_cache_hits: int = 0  # of those, tokens found (their prefill was skipped)
    num_preemptions: int = 0  # all of them: for KV blocks and for priority
    num_priority_preemptions: int = 0  # a waiting request outranked a running one
    num_slot_share_preemptions: int = 0  # a tenant short of its share of max_num_seqs
    num_steps_given_way: int = 0  # abandoned mid-way for a newcomer (Engine._interruption)
    num_rejected_overloaded: int = 0  # shed: at submission, or displaced by a more urgent one
    num_rejected_deadline: int = 0  # deadline_exceeded, at submission or in the queue
    waiting_tokens: int = 0  # tokens the waiting requests must compute (shedding)
    step_prefill_tokens: int = 0
    step_decode_tokens: int = 0
    total_prefill_tokens: int = 0
    total_decode_tokens: int = 0
    # The step-cost fit (backend/engine/step_cost.py) and the budget it set.
    step_time_predicted_s: float = 0.0  # the last step's time, as predicted before it ran
    step_time_actual_s: float = 0.0  # and as measured
    step_time_error_ratio: float = 0.0  # moving average of |predicted - actual| / actual
    step_cost_s: dict[str, float] = field(default_factory=dict)  # seconds per unit of each term
    step_time_limit_s: float | None = None  # the time target of the last step; None: static
    step_prefill_budget: int = 0  # prefill tokens the last step could take
    # Speculative decoding (backend/engine/speculative.py), cumulative; vLLM's names.
    speculative_method: str = "off"
    spec_decode_num_drafts: int = 0  # verified rows that carried draft tokens
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    # LoRA adapters (max_loras > 0): vLLM's vllm:lora_requests_info labels, and how many
    # times an adapter was read into a device slot.
    max_lora: int = 0
    running_lora_adapters: list[str] = field(default_factory=list)
    waiting_lora_adapters: list[str] = field(default_factory=list)
    loaded_lora_adapters: list[str] = field(default_factory=list)  # resident in a slot
    lora_loads: int = 0

    @property
    def spec_decode_acceptance_rate(self) -> float:
        """Accepted draft tokens over draft tokens; 0.0 before any."""
        drafted = self.spec_decode_num_draft_tokens
        return self.spec_decode_num_accepted_tokens / drafted if drafted else 0.0

    @property
    def spec_decode_tokens_per_step(self) -> float:
        """Tokens a row with drafts produced per step: 1 + accepted drafts per row (vLLM's
        mean acceptance length); 0.0 before any."""
        rows = self.spec_decode_num_drafts
        return 1 + self.spec_decode_num_accepted_tokens / rows if rows else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )
