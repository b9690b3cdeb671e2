"""Turns last-position logits into one token per sequence.

Everything here stays on the logits' device and works on the whole batch at once: the
per-request parameters arrive as tensors (`SamplingTensors`, staged by the model runner
with the step's other inputs), so sampling never waits for the GPU. The only wait is the
runner's read-back of the tokens (and logprobs) at the end of the step."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from backend.layers.staging import Staging
from backend.outputs import TokenLogprobs
from backend.sampling import SamplingParams


@dataclass(frozen=True)
class SamplingTensors:
    """Per-row parameters, [B] each; the flags skip work no row needs."""

    temperature: torch.Tensor  # float32; 1.0 for greedy rows (unused there)
    top_k: torch.Tensor  # int64; vocab size when off
    top_p: torch.Tensor  # float32
    greedy: torch.Tensor  # bool
    min_p: torch.Tensor  # float32; 0 when off
    all_greedy: bool
    any_greedy: bool
    use_top_k: bool
    use_top_p: bool
    use_min_p: bool

    @staticmethod
    def stage(stage: Staging, params: Sequence[SamplingParams], vocab: int) -> None:
        if all(p.greedy for p in params):
            return
        stage.add("temperature", [p.temperature or 1.0 for p in params], torch.float32)
        stage.add("top_k", [p.top_k or vocab for p in params])
        stage.add("top_p", [p.top_p for p in params], torch.float32)
        stage.add("greedy", [int(p.greedy) for p in params])
        if any(p.min_p for p in params):
            stage.add("min_p", [p.min_p for p in params], torch.float32)

    @classmethod
    def of(
        cls, staged: dict[str, torch.Tensor], params: Sequence[SamplingParams]
    ) -> SamplingTensors:
        all_greedy = all(p.greedy for p in params)
        if all_greedy:
            empty = torch.empty(0)
            return cls(empty, empty, empty, empty, empty, True, True, False, False, False)
        return cls(
            staged["temperature"],
            staged["top_k"],
            staged["top_p"],
            staged["greedy"].bool(),
            staged.get("min_p", torch.empty(0)),
            all_greedy=False,
            any_greedy=any(p.greedy for p in params),
            use_top_k=any(p.top_k for p in params),
            use_top_p=any(p.top_p < 1 for p in params),
            use_min_p="min_p" in staged,
        )

    def select(self, rows: torch.Tensor) -> SamplingTensors:
        """These rows' parameters (the flags stay the whole batch's: they only skip work)."""
        if self.all_greedy:
            return self
        pick = functools.partial(torch.Tensor.index_select, dim=0, index=rows)
        min_p = pick(self.min_p) if self.use_min_p else self.min_p
        return replace(
            self,
            temperature=pick(self.temperature),
            top_k=pick(self.top_k),
            top_p=pick(self.top_p),
            greedy=pick(self.greedy),
            min_p=min_p,
        )

    @classmethod
    def build(
        cls, params: Sequence[SamplingParams], vocab: int, device: torch.device
    ) -> SamplingTensors:
        stage = Staging(device)
        cls.stage(stage, params, vocab)
        return cls.of(stage.upload(), params)


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Constrained rows' grammar masks, in place: logits [B, vocab] on `rows` [R];
    bitmask [R, ceil(vocab / 32)] int32 on the logits' device, bit j of word w allowing
    token 32 w + j. Every other token gets the lowest finite logit: probability 0, and a
    logprob that JSON can still carry."""
    bits = bitmask[:, :, None] >> _bit_shifts(bitmask.device) & 1
    blocked = (bits == 0).flatten(1)[:, : logits.shape[-1]]
    masked = logits.index_select(0, rows).masked_fill_(blocked, torch.finfo(logits.dtype).min)
    logits.index_copy_(0, rows, masked)


@functools.cache
def _bit_shifts(device: torch.device) -> torch.Tensor:
    return torch.arange(32, dtype=torch.int32, device=device)


def sample_tokens(
    logits: torch.Tensor,
    generators: Sequence[torch.Generator | None],
    tensors: SamplingTensors,
) -> torch.Tensor:
    """logits: [B, vocab] -> [B] token ids, on the logits' device. Greedy rows take the
    argmax; the others draw by inverse CDF (`_draw`), each seeded row from its own
    generator so its draw does not depend on the batch."""
    logits = logits.float()
    if tensors.all_greedy:
        return logits.argmax(dim=-1)
    sampled = _draw(torch.softmax(_scaled(logits, tensors), dim=-1), generators)
    # A row with no distribution to draw from (NaN or infinite logits, from the model or a
    # parameter) takes its argmax rather than an id past the vocabulary, which would fail
    # the next step for every request in the batch. No wait: all on the device.
    greedy = sampled < 0
    if tensors.any_greedy:
        greedy |= tensors.greedy
    return torch.where(greedy, logits.nan_to_num(nan=float("-inf")).argmax(dim=-1), sampled)


def _scaled(logits: torch.Tensor, tensors: SamplingTensors) -> torch.Tensor:
    """float32 logits after temperature, top-k/top-p and min_p."""
    scaled = _top_k_top_p(logits / tensors.temperature[:, None], tensors)
    if tensors.use_min_p:
        scaled = _min_p(scaled, tensors.min_p)
    return scaled


def sampling_probs(logits: torch.Tensor, tensors: SamplingTensors) -> torch.Tensor:
    """[B, vocab] float32: the distribution `sample_tokens` draws each row from; a
    greedy row's is all on its argmax."""
    logits = logits.float()
    argmax = logits.nan_to_num(nan=float("-inf")).argmax(dim=-1, keepdim=True)
    one_hot = torch.zeros_like(logits).scatter_(-1, argmax, 1.0)
    if tensors.all_greedy:
        return one_hot
    probs = torch.softmax(_scaled(logits, tensors), dim=-1)
    if tensors.any_greedy:
        probs = torch.where(tensors.greedy[:, None], one_hot, probs)
    return probs


def uniforms(
    shape: tuple[int, int], generators: Sequence[torch.Generator | None], device: torch.device
) -> torch.Tensor:
    """[B, n] uniform draws in [0, 1); row i from generators[i] when it has one."""
    u = torch.rand(shape, device=device)
    for i, gen in enumerate(generators):
        if gen is not None:
            u[i].uniform_(generator=gen)
    return u


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[B] tokens: in each row of probs [B, vocab], the first whose cumulative probability
    passes u [B, 1] (scaled to the row's sum). -1 for a row whose sum is not finite."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]  # about 1; the draw is scaled to it, so rounding cannot overshoot
    # Strictly below the total (u * total may round up to it): some token always passes.
    target = torch.minimum(u * total, total.nextafter(torch.zeros_like(total)))
    tokens = torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[-1] - 1)
    return tokens.masked_fill_(~torch.isfinite(total), -1).squeeze(-1)


def _draw(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row of probs [B, vocab]: the first whose cumulative probability
    passes a uniform draw. One uniform per row rather than an exponential per token (the
    exponential-race trick), several times cheaper on the CPU, and no wait on a GPU.
    A token of probability 0 adds nothing to the sum, so it is never the first to pass.
    A row whose sum is not finite (NaN) gets -1: it has no token to draw."""
    return inverse_cdf(probs, uniforms((probs.shape[0], 1), generators, probs.device))


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """`sample_tokens` with the parameters built here, read back as a list."""
    tensors = SamplingTensors.build(params, logits.shape[-1], logits.device)
    return sample_tokens(logits, generators, tensors).tolist()  # type: ignore[no-any-return]


def _min_p(scaled: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop the tokens whose probability is below min_p x the row's most likely one's
    (a row's own min_p; 0 keeps every token). In logits: p_i / p_max = exp(l_i - l_max)."""
    floor = scaled.amax(dim=-1, keepdim=True) + torch.log(min_p[:, None])
    return scaled.masked_fill(scaled < floor, float("-inf"))


def _top_k_top_p(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    if not (t.use_top_k or t.use_top_p):
        return logits
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if t.use_top_k:
        ranks = torch.arange(vocab, device=logits.device)
        sorted_logits.masked_fill_(ranks[None, :] >= t.top_k[:, None], float("-inf"))
    if t.use_top_p:
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token once the tokens ranked above it already cover top_p (keeps >= 1).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_logits.masked_fill_(mass_before > t.top_p[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(-1, order, sorted_logits)


def apply_penalties(
    row: torch.Tensor, params: SamplingParams, in_prompt: torch.Tensor, output: list[int]
) -> None:
    """One row of logits, in place (the readable form of `apply_penalties_batch`).
    `in_prompt`: a [vocab] mask of the prompt's tokens (the repetition penalty also
    counts them); `output`: the tokens so far."""
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


def apply_penalties_batch(
    logits: torch.Tensor,
    rows: torch.Tensor,
    in_prompt: torch.Tensor,
    outputs: torch.Tensor,
    values: torch.Tensor,
) -> None:
    """logits: [B, vocab] float, changed in place on `rows` [R]. in_prompt: [R, vocab]
    bool; outputs: [R, L] each row's tokens so far, padded with -1; values: [R, 3] its
    repetition, presence and frequency penalties. The same arithmetic as apply_penalties
    (a penalty at its neutral value changes nothing)."""
    counts = torch.zeros(rows.shape[0], logits.shape[-1], device=logits.device)
    counts.scatter_add_(1, outputs.clamp_min(0), (outputs >= 0).float())
    rep, presence, frequency = (v[:, None] for v in values.unbind(-1))
    sub = logits[rows]
    seen = in_prompt | (counts > 0)
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub -= frequency * counts + presence * (counts > 0)
    logits[rows] = sub


LogprobTensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def logprob_tensors(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> LogprobTensors:
    """On the device, for one read-back: each row's chosen token's logprob under the raw
    distribution [R], its rank [R], and the k most likely alternatives [R, k] (ids, lps)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = tokens[:, None]
    chosen_lp = logprobs.gather(-1, chosen)
    ranks = (logprobs > chosen_lp).sum(-1) + 1
    top_lp, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], chosen[:, :0])
    return chosen_lp[:, 0], ranks, top_ids, top_lp


def assemble_logprobs(
    tokens: Sequence[int], host: LogprobTensors, num_top: Sequence[int]
) -> list[TokenLogprobs]:
    chosen_lp, ranks, top_ids, top_lp = host
    rows = zip(
        tokens,
        chosen_lp.tolist(),
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


def token_logprobs(
    logits: torch.Tensor, tokens: Sequence[int], num_top: Sequence[int]
) -> list[TokenLogprobs]:
    """Logprobs of each row's chosen token, its rank, and its num_top alternatives."""
    chosen = torch.tensor(list(tokens), device=logits.device)
    host = logprob_tensors(logits, chosen, max(num_top))
    return assemble_logprobs(tokens, host, num_top)
