"""Turns last-position logits into one token per sequence."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from backend.outputs import TokenLogprobs
from backend.sampling import SamplingParams


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """logits: [B, vocab]. Greedy rows take the argmax; the others draw with the
    exponential trick (argmax of p / q, q ~ Exp(1)), each seeded row from its own
    generator so its draw does not depend on the rest of the batch."""
    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    if all(p.greedy for p in params):
        return greedy.tolist()  # type: ignore[no-any-return]
    temps = torch.tensor([p.temperature or 1.0 for p in params], device=logits.device)
    probs = torch.softmax(_top_k_top_p(logits / temps[:, None], params), dim=-1)
    q = torch.empty_like(probs).exponential_()
    for i, gen in enumerate(generators):
        if gen is not None:
            q[i].exponential_(generator=gen)
    sampled = probs.div_(q.clamp_min_(1e-10)).argmax(dim=-1)
    is_greedy = torch.tensor([p.greedy for p in params], device=logits.device)
    return torch.where(is_greedy, greedy, sampled).tolist()  # type: ignore[no-any-return]


def _top_k_top_p(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    use_k = any(p.top_k for p in params)
    use_p = any(p.top_p < 1 for p in params)
    if not (use_k or use_p):
        return logits
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if use_k:
        k = torch.tensor([p.top_k or vocab for p in params], device=logits.device)
        ranks = torch.arange(vocab, device=logits.device)
        sorted_logits.masked_fill_(ranks[None, :] >= k[:, None], float("-inf"))
    if use_p:
        top_p = torch.tensor([p.top_p for p in params], device=logits.device)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token once the tokens ranked above it already cover top_p (keeps >= 1).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_logits.masked_fill_(mass_before > top_p[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(-1, order, sorted_logits)


def apply_penalties(
    row: torch.Tensor, params: SamplingParams, in_prompt: torch.Tensor, output: list[int]
) -> None:
    """Penalise one row of logits in place. `in_prompt`: a [vocab] mask of the prompt's
    tokens (the repetition penalty also counts them); `output`: the tokens so far."""
    counts = None
    if output:
        ids = torch.tensor(output, device=row.device)
        counts = torch.bincount(ids, minlength=row.numel())
    rp = params.repetition_penalty
    if rp != 1:
        seen = in_prompt if counts is None else in_prompt | (counts > 0)
        row.copy_(torch.where(seen, torch.where(row > 0, row / rp, row * rp), row))
    if counts is not None and (params.presence_penalty or params.frequency_penalty):
        row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)


def token_logprobs(
    logits: torch.Tensor, tokens: Sequence[int], num_top: Sequence[int]
) -> list[TokenLogprobs]:
    """Logprobs of each row's chosen token under the raw distribution, its rank, and the
    row's num_top most likely alternatives (one topk for the whole batch)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = torch.tensor(tokens, device=logits.device)[:, None]
    chosen_lp = logprobs.gather(-1, chosen)
    ranks = (logprobs > chosen_lp).sum(-1) + 1
    k = max(num_top)
    top_lp, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], chosen[:, :0])
    rows = zip(
        tokens,
        chosen_lp[:, 0].tolist(),
        ranks.tolist(),
        top_ids.tolist(),
        top_lp.tolist(),
        num_top,
        strict=True,
    )
    return [
        TokenLogprobs(token, lp, rank, list(zip(ids[:n], lps[:n], strict=True)))
        for token, lp, rank, ids, lps, n in rows
    ]
