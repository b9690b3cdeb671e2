"""The draft model of `speculative_method="draft"`: a small checkpoint of the target's
tokenizer that proposes each decode row's draft tokens inside the step, before the
target verifies them.

Its KV cache is paged like the target's and shares the target's block tables: a pool of
the same number of blocks, in which block b holds the draft's keys and values for the
same positions as the target's block b. So the block manager's accounting, preemption
and the rollback of rejected slots cover it unchanged.

The draft computes a request's tokens only when the request drafts: while drafting is
paused (or the row cannot draft, or is a prompt chunk) its KV lags behind the target's,
and the next step that drafts catches it up with one pass over the tokens it missed
(prefill-style: many tokens a row, far cheaper per token than a pass a step). It knows
where each request's draft KV ends (`_done`): from 0 for a new request (a prefix-cache
hit holds the target's KV, the draft's only if a drafting request wrote it) and after a
preemption (the blocks were freed); after a verification, up to the accepted drafts its
draft steps computed (the last draft of a row whose every draft passed was never its
input)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from backend.attention_metadata import AttentionMetadata
from backend.engine.batch import ScheduledRequest, SchedulerOutput
from backend.engine.block_tables import DeviceBlockTables
from backend.engine.cuda_graphs import DecodeGraphs
from backend.errors import CheckpointError
from backend.layers import kv_quant
from backend.layers.attention import AttentionBackend
from backend.layers.sampler import SamplingTensors, inverse_cdf, sampling_probs, uniforms
from backend.layers.staging import to_host
from backend.loader import load_model
from backend.models.config import ModelConfig, load_model_config
from backend.models.llama import LlamaForCausalLM

# The runner's ModelRunner._prepare: a batch's input ids, positions and metadata.
Prepare = Callable[[SchedulerOutput], tuple[torch.Tensor, torch.Tensor, AttentionMetadata]]


class DraftModel:
    def __init__(
        self,
        model_dir: Path,
        target: ModelConfig,
        *,
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int,
        backend: AttentionBackend,
        max_tokens: int,
    ) -> None:
        self.config = load_model_config(model_dir)
        if self.config.vocab_size != target.vocab_size:
            raise CheckpointError(
                model_dir,
                f"the draft model's vocabulary ({self.config.vocab_size}) is not the "
                f"target's ({target.vocab_size}): it needs the same tokenizer",
            )
        self.model: LlamaForCausalLM = load_model(
            model_dir,
            self.config,
            dtype=dtype,
            device=device,
            max_positions=max_positions,
            backend=backend,
        )
        self.device = device
        self.dtype = dtype
        self.kv_cache: torch.Tensor | None = None  # sized by the runner: allocate()
        # Its draft steps' CUDA graphs (one token a row), captured by the runner with its
        # own; `use_graphs` follows the runner's switch.
        self.graphs: DecodeGraphs | None = None
        self.use_graphs = True
        self.max_tokens = max_tokens  # the most tokens of one catch-up pass
        # request -> (its preemption count, positions 0..n-1 whose KV the draft holds)
        self._done: dict[str, tuple[int, int]] = {}
        # Rows drafted this step: (end of the real tokens, end of the KV the draft steps wrote)
        self._fed: dict[str, tuple[int, int]] = {}
        self.passes = 0  # forward passes of the draft (catch-ups and draft steps)

    def allocate(self, num_blocks: int, block_size: int, kv_dtype: torch.dtype) -> None:
        """Its pool, in the target's KV dtype (a quantized cache quantizes both)."""
        cfg = self.config
        self.kv_cache = kv_quant.allocate(cfg, num_blocks, block_size, kv_dtype, self.device)

    def propose(
        self,
        batch: SchedulerOutput,
        prepare: Prepare,
        generators: dict[str, torch.Generator | None],
        tables: DeviceBlockTables | None = None,
    ) -> torch.Tensor | None:
        """Catch the draft's cache up on the tokens of each row with drafts, then fill its
        draft placeholders (the last num_drafts of its token_ids) with tokens drawn from
        the draft's distribution q (greedy rows: its argmax). Returns q of every draft
        token, [rows with drafts, K, vocab], for the verifier; None (and no pass of the
        draft at all) when no row drafts. `tables`: the runner's device block tables, for
        the draft steps' graph replays."""
        assert self.kv_cache is not None
        spec = [r for r in batch.requests if r.num_drafts]
        if not spec:
            return None
        k = max(r.num_drafts for r in spec)
        vocab = self.config.vocab_size
        sampling = SamplingTensors.build([r.params for r in spec], vocab, self.device)
        gens = [generators.get(r.request_id) for r in spec]
        q = torch.zeros(len(spec), k, vocab, device=self.device)
        logits = self.model.logits(self._catch_up(spec, prepare))
        for j in range(k):
            probs = sampling_probs(logits, sampling)
            q[:, j] = probs
            drafts = to_host(inverse_cdf(probs, uniforms((len(spec), 1), gens, self.device)))[0]
            for r, token in zip(spec, drafts.tolist(), strict=True):
                if j < r.num_drafts:
                    r.token_ids[len(r.token_ids) - r.num_drafts + j] = max(token, 0)
            if j + 1 == k:
                break
            rows = [_draft_row(r, j) for r in spec]
            graphs = self.graphs if self.use_graphs else None
            if graphs is not None and tables is not None and graphs.takes(rows):
                self.passes += 1
                hidden = graphs.replay_rows(rows, tables)
            else:
                hidden = self._run(SchedulerOutput(rows), prepare)
            logits = self.model.logits(hidden)
        for r in spec:  # the draft steps wrote the KV of its first k - 1 drafts
            real_end = r.start_pos + len(r.token_ids) - r.num_drafts
            self._fed[r.request_id] = (real_end, real_end + min(r.num_drafts, k - 1))
        return q

    def _catch_up(self, spec: list[ScheduledRequest], prepare: Prepare) -> torch.Tensor:
        """One pass (chunks of at most max_tokens) over each row's tokens the draft has
        not computed: those since it last drafted, and the row's own. Returns the hidden
        state of each row's last real token, [len(spec), hidden]."""
        pieces: list[list[ScheduledRequest]] = [[]]
        used = 0
        last: list[tuple[int, int]] = []  # each row's (pass, index) of its last token
        for r in spec:
            start, tokens = self._missing(r)
            at = 0
            while at < len(tokens):
                if used == self.max_tokens:
                    pieces.append([])
                    used = 0
                take = min(self.max_tokens - used, len(tokens) - at)
                piece = tokens[at : at + take]
                pieces[-1].append(replace(r, token_ids=piece, start_pos=start + at))
                at, used = at + take, used + take
            last.append((len(pieces) - 1, used - 1))
            self._done[r.request_id] = (r.num_preemptions, start + len(tokens))
        hidden = [self._run(SchedulerOutput(rows), prepare) for rows in pieces]
        return torch.stack([hidden[p][i] for p, i in last])

    def _missing(self, r: ScheduledRequest) -> tuple[int, list[int]]:
        """Where the draft's cache of the row's request ends, and the tokens from there to
        the row's last real one. From 0 after a preemption (its blocks were freed, the
        draft's KV with them) and for a new request (a prefix-cache hit holds the
        target's KV, and the draft's only if a request that drafted wrote it)."""
        epoch, done = self._done.get(r.request_id, (r.num_preemptions, 0))
        done = min(done, r.start_pos) if epoch == r.num_preemptions else 0
        real = r.token_ids[: len(r.token_ids) - r.num_drafts]
        return done, _history(r, done, r.start_pos) + real

    def verified(self, request_id: str, num_accepted: int) -> None:
        """A row's verification: the draft's cache holds its real tokens and the accepted
        drafts the draft steps computed (all but the last when every one passed)."""
        fed = self._fed.pop(request_id, None)
        if fed is not None:
            real_end, end = fed
            epoch, _ = self._done[request_id]
            self._done[request_id] = (epoch, min(end, real_end + num_accepted))

    def forget(self, request_ids: list[str]) -> None:
        """Requests that left: nothing of theirs is kept."""
        for request_id in request_ids:
            self._done.pop(request_id, None)
            self._fed.pop(request_id, None)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states of a batch over the draft's own KV cache (what its graphs capture)."""
        hidden: torch.Tensor = self.model(input_ids, positions, self.kv_cache, meta)
        return hidden

    def _run(self, batch: SchedulerOutput, prepare: Prepare) -> torch.Tensor:
        self.passes += 1
        input_ids, positions, meta = prepare(batch)
        return self.forward(input_ids, positions, meta)


def _draft_row(r: ScheduledRequest, j: int) -> ScheduledRequest:
    """Draft j (0-based) of the row as a one-token row at its position; rows with fewer
    drafts recompute their last one (harmless: the same KV again)."""
    at = min(j, r.num_drafts - 1)
    real = len(r.token_ids) - r.num_drafts
    return replace(r, token_ids=[r.token_ids[real + at]], start_pos=r.start_pos + real + at)


def _history(r: ScheduledRequest, start: int, end: int) -> list[int]:
    """The request's tokens at positions start..end-1, from its prompt and output."""
    prompt = r.prompt_token_ids
    tokens = prompt[start:end]
    if end > len(prompt):
        tokens += r.output_token_ids[max(start - len(prompt), 0) : end - len(prompt)]
    return tokens
