"""Speculative decoding: which decode rows get draft tokens, and how many were accepted.

A decode row with drafts d_1..d_k computes k + 1 tokens in one forward pass of the target
model (its last token, then the drafts), and the sampler verifies them
(backend/layers/rejection.py): the accepted drafts and one more token come out of one
step. Drafts come from the request's own tokens (`ngram`: prompt lookup) or from a small
draft model (`draft`: the model runner drafts them in the step itself, see
backend/engine/draft.py).

Adaptive: each request keeps an acceptance average, starting from the engine's; when it
falls below the floor (`MIN_ACCEPTANCE`, or for a draft model the cost of one draft
token in target steps, if higher) the request stops drafting for a pause that doubles
each time a probe fails again, and new requests start paused as long as the longest
pause so far, so a workload whose drafts are rarely accepted pays almost nothing.
Which drafts run in a step is then the scheduler's choice, by the step-cost fit
(Scheduler._add_drafts)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from backend.engine.request import Request

# The longest and shortest suffix looked up in the request's tokens (longest first).
NGRAM_MAX, NGRAM_MIN = 4, 2
_EMA = 0.3  # weight of the newest verification in a request's acceptance average
_GLOBAL_EMA = 0.05  # and in the engine's, which new requests start from
MIN_ACCEPTANCE = 0.1  # below it (accepted drafts per draft token), drafting pauses
FIRST_PAUSE, LONGEST_PAUSE = 8, 256  # steps without drafts after a bad streak


@dataclass(slots=True)
class SpecState:
    """One request's drafting record, and its n-gram index."""

    acceptance: float = 1.0  # moving average of accepted / drafted
    paused_until: int = 0  # the step from which it drafts again
    pause: int = FIRST_PAUSE  # the next pause's length
    # Each n-gram (NGRAM_MIN <= n <= NGRAM_MAX) of the request's tokens -> where the
    # tokens after its latest occurrence start; kept up to date a few tokens a step.
    ngrams: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0  # n-grams ending before this position are in `ngrams`


@dataclass
class SpecCounters:
    """Cumulative, as vLLM's spec_decode metrics count them."""

    num_drafts: int = 0  # verified rows that carried at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # at draft position 0..K-1


def can_speculate(req: Request) -> bool:
    """Rows the verifier can take exactly: not while a grammar constrains the next
    tokens, penalties or min_tokens masks change from one position to the next, or
    logprobs are asked for; nor a seeded sampled row, whose tokens must not depend on
    which steps drafted (that depends on timing). Those rows decode one token a step."""
    p = req.params
    return (
        req.matcher is None
        and not p.penalized
        and p.logprobs is None
        and (p.seed is None or p.greedy)
        and len(req.output_token_ids) >= p.min_tokens
    )


def max_drafts(req: Request, k: int) -> int:
    """At most k, and no more than the output may still hold after this step's own token."""
    left = min(req.params.max_tokens - len(req.output_token_ids), req.max_len - req.num_tokens)
    return max(0, min(k, left - 1))


def ngram_drafts(req: Request, state: SpecState, k: int) -> list[int]:
    """Prompt lookup: the k tokens that followed the latest earlier occurrence of the
    request's last n tokens (n from NGRAM_MAX down to NGRAM_MIN). Only n-grams with a
    token after them are indexed, so the suffix never finds itself."""
    total = req.num_tokens
    low = max(state.indexed - NGRAM_MAX + 1, 0)
    tokens = req.token_ids(low, total)
    ngrams = state.ngrams
    for end in range(state.indexed, total - 1):  # n-grams ending at `end`
        at = end - low
        for n in range(NGRAM_MIN, min(NGRAM_MAX, end + 1) + 1):
            ngrams[tuple(tokens[at - n + 1 : at + 1])] = end + 1
    state.indexed = max(state.indexed, total - 1)
    for n in range(min(NGRAM_MAX, len(tokens)), NGRAM_MIN - 1, -1):
        start = ngrams.get(tuple(tokens[len(tokens) - n :]))
        if start is not None:
            return req.token_ids(start, min(start + k, total))
    return []


class Speculator:
    """Proposes each step's drafts and records their acceptance (the step thread's).
    `draft_cost`: what one draft token costs, in decode steps of the target (a draft
    model's pass over its parameters against the target's: `draft_cost_ratio`); a
    request whose acceptance stays below it loses time drafting, so it pauses as below
    MIN_ACCEPTANCE (n-gram drafts cost nothing to make: 0)."""

    def __init__(self, method: str, k: int, draft_cost: float = 0.0) -> None:
        self.method = method
        self.k = k
        self.min_acceptance = max(MIN_ACCEPTANCE, draft_cost)
        self.states: dict[str, SpecState] = {}
        self.counters = SpecCounters(accepted_per_pos=[0] * k)
        self.step = 0
        # Acceptance over all requests: a new request starts from it, so a workload whose
        # drafts are rarely accepted does not pay a few failed verifications per request.
        self.acceptance = 1.0
        # A new request's first pause when that is below the floor: the longest pause a
        # request has reached since a row last accepted every draft, so where every
        # probe fails, short requests stop probing at all (each probe of a draft model
        # costs its passes, and a catch-up over the prompt).
        self.pause = FIRST_PAUSE

    def propose(self, running: list[Request]) -> None:
        """Drafts for the next step of each decoding request, in `req.spec_token_ids`.
        With the draft model they are placeholders (-1) that the model runner fills."""
        self.step += 1
        for req in running:
            req.spec_token_ids = []
            if req.num_computed_tokens + 1 != req.num_tokens or not can_speculate(req):
                continue  # still prefilling, or a row the verifier cannot take
            state = self.states.get(req.request_id)
            if state is None:
                state = self.states[req.request_id] = self._new_state()
            if self.step < state.paused_until:
                continue
            k = max_drafts(req, self.k)
            if k == 0:
                continue
            if self.method == "draft":
                req.spec_token_ids = [-1] * k
            else:
                req.spec_token_ids = ngram_drafts(req, state, k)
            req.spec_gain = state.acceptance * len(req.spec_token_ids)

    def _new_state(self) -> SpecState:
        state = SpecState(acceptance=self.acceptance)
        if self.acceptance < self.min_acceptance:  # a probe after the first pause
            state.paused_until = self.step + self.pause
            state.pause = min(2 * self.pause, LONGEST_PAUSE)
            state.acceptance = self._probe_acceptance()
        return state

    def _probe_acceptance(self) -> float:
        """A paused request's average when it probes again: one bad verification pauses
        it again, a good one resumes it."""
        floor = self.min_acceptance
        return floor + _EMA * (1 - floor) / 2

    def observe(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """A verified row: `num_accepted` of its `num_drafts` drafts were taken."""
        c = self.counters
        c.num_drafts += 1
        c.num_draft_tokens += num_drafts
        c.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            c.accepted_per_pos[i] += 1
        self.acceptance += _GLOBAL_EMA * (num_accepted / num_drafts - self.acceptance)
        state = self.states.get(request_id)
        if state is None:
            return
        state.acceptance += _EMA * (num_accepted / num_drafts - state.acceptance)
        if num_accepted == num_drafts:
            state.pause = self.pause = FIRST_PAUSE
        elif state.acceptance < self.min_acceptance:
            state.paused_until = self.step + state.pause
            self.pause = max(self.pause, state.pause)
            state.pause = min(2 * state.pause, LONGEST_PAUSE)
            state.acceptance = self._probe_acceptance()

    def forget(self, request_id: str) -> None:
        self.states.pop(request_id, None)


def draft_cost_ratio(draft: torch.nn.Module, target: torch.nn.Module) -> float:
    """The draft model's parameters over the target's (each counted once, a tied LM head
    included): what a draft token costs in target decode steps, as a decode step reads
    every weight once (memory-bound on a GPU, and about so on a CPU at small batches)."""
    return _num_params(draft) / max(_num_params(target), 1)


def _num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
