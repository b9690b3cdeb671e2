"""Verification of draft tokens by rejection sampling (Leviathan et al., 2023), which keeps
the target model's distribution exactly.

Row s carries k_s drafts d_1..d_k drawn from a proposal q (a draft model's distribution,
or one-hot for drafts looked up in the text) and the target's distributions p_1..p_{k+1}
at the same positions (after temperature, top-k/top-p and min_p: what `sample_tokens`
would draw from; one-hot on the argmax for greedy rows). Draft j is accepted with
probability min(1, p_j(d_j) / q_j(d_j)), in order, until one is rejected; at the first
rejection the row draws its next token from norm(max(0, p_j - q_j)), and when all are
accepted it draws one more from p_{k+1}. With q one-hot this is: accept d_j with
probability p_j(d_j), else draw from p_j without d_j, renormalised. A greedy row (p
one-hot) accepts exactly the drafts its argmax agrees with and ends on the argmax, so
its tokens are those of decoding one at a time."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from backend.layers.sampler import inverse_cdf, uniforms


def rejection_sample(
    target_probs: torch.Tensor,
    draft_ids: torch.Tensor,
    num_drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generators: Sequence[torch.Generator | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """target_probs [S, K+1, vocab]; draft_ids [S, K] (rows with fewer than K drafts
    padded with any valid id); num_drafts [S]; draft_probs [S, K, vocab] or None for
    one-hot proposals. Returns (accepted [S]: how many leading drafts are kept, token
    [S]: the token drawn after them), on the device. Each row takes K + 1 uniforms from
    its generator, if it has one."""
    rows, k = draft_ids.shape
    index = torch.arange(rows, device=draft_ids.device)
    u = uniforms((rows, k + 1), generators, target_probs.device)
    p_draft = target_probs[:, :k].gather(-1, draft_ids[..., None]).squeeze(-1)  # [S, K]
    q_draft = (
        torch.ones_like(p_draft)
        if draft_probs is None
        else draft_probs.gather(-1, draft_ids[..., None]).squeeze(-1)
    )
    valid = torch.arange(k, device=u.device)[None, :] < num_drafts[:, None]
    # u < p / q, without the division (q > 0 for a token drawn from q).
    accept = (u[:, :k] * q_draft < p_draft) & valid
    accepted = accept.long().cumprod(dim=1).sum(dim=1)  # leading run of acceptances
    p_next = target_probs[index, accepted]  # [S, vocab]
    at = accepted.clamp(max=k - 1)
    if draft_probs is None:
        q_next = torch.zeros_like(p_next).scatter_(-1, draft_ids[index, at][:, None], 1.0)
    else:
        q_next = draft_probs[index, at]
    residual = (p_next - q_next).clamp_min_(0)
    # A rejection draws from the residual; one whose residual vanished (p == q up to
    # rounding: it had probability 0 of being rejected) draws from p instead.
    rejected = (accepted < num_drafts) & (residual.sum(dim=-1) > 0)
    dist = torch.where(rejected[:, None], residual, p_next)
    token = inverse_cdf(dist, u[:, k:])
    # No distribution to draw from (NaN logits): the argmax, as sample_tokens does.
    token = torch.where(token < 0, p_next.nan_to_num(nan=-1.0).argmax(dim=-1), token)
    return accepted, token


def greedy_verify(
    target_ids: torch.Tensor, draft_ids: torch.Tensor, num_drafts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rejection_sample` for greedy rows (whatever q): target_ids [S, K+1] the argmax at
    each position. The drafts the argmax agrees with, in order, then the argmax after
    them; no distribution is built."""
    k = draft_ids.shape[1]
    valid = torch.arange(k, device=draft_ids.device)[None, :] < num_drafts[:, None]
    agree = (target_ids[:, :k] == draft_ids) & valid
    accepted = agree.long().cumprod(dim=1).sum(dim=1)
    return accepted, target_ids.gather(1, accepted[:, None]).squeeze(1)
