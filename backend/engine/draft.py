"""The draft model of `speculative_method="draft"`: a small checkpoint of the target's
tokenizer that proposes each decode row's draft tokens inside the step, before the
target verifies them.

Its KV cache is paged like the target's and shares the target's block tables: a pool of
the same number of blocks, in which block b holds the draft's keys and values for the
same tokens as the target's block b. So the block manager's accounting, the prefix cache
(a hit block holds both models' KV), preemption and the rollback of rejected slots cover
it unchanged. To keep that true the draft computes every token the target computes
(prompt chunks included: the small model's share of each step), and after a step whose
drafts were all accepted its next decode row recomputes the position before the last
token too: the draft never saw its own last draft as input. (Only then: a two-token row
costs a CPU a prompt's path through attention, several times a decode row's.)"""

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
# What writes the step in flight's sampled tokens over a batch's PLACEHOLDER input ids on
# the device (async scheduling), for that batch; None when it has none.
PatchFor = Callable[[SchedulerOutput], Callable[[torch.Tensor], object] | None]


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
        # Requests whose last verification accepted every draft: the KV of the last
        # draft's position is missing from the draft's cache until their next step.
        self.behind: set[str] = set()

    def allocate(self, num_blocks: int, block_size: int, kv_dtype: torch.dtype) -> None:
        """Its pool, in the target's KV dtype (a quantized cache quantizes both)."""
        cfg = self.config
        self.kv_cache = kv_quant.allocate(cfg, num_blocks, block_size, kv_dtype, self.device)

    def propose(
        self,
        batch: SchedulerOutput,
        prepare: Prepare,
        generators: dict[str, torch.Generator | None],
        patch_for: PatchFor | None = None,
        tables: DeviceBlockTables | None = None,
    ) -> torch.Tensor | None:
        """Mirror the step's tokens into the draft's cache, then fill each row's draft
        placeholders (the last num_drafts of its token_ids) with tokens drawn from the
        draft's distribution q (greedy rows: its argmax). Returns q of every draft token,
        [rows with drafts, K, vocab], for the verifier; None when no row drafts.
        `patch_for`: async scheduling's patch of input ids still on the device (rows
        without drafts only: a row drafts only when all its tokens are known). `tables`:
        the runner's device block tables, for the draft steps' graph replays."""
        assert self.kv_cache is not None
        spec = [r for r in batch.requests if r.num_drafts]
        first = SchedulerOutput([self._mirrored(r) for r in batch.requests])
        hidden = self._run(first, prepare, None if patch_for is None else patch_for(first))
        if not spec:
            return None
        ends, end = [], 0
        for r in first.requests:
            end += len(r.token_ids)
            if r.num_drafts:
                ends.append(end - 1)
        k = max(r.num_drafts for r in spec)
        vocab = self.config.vocab_size
        sampling = SamplingTensors.build([r.params for r in spec], vocab, self.device)
        gens = [generators.get(r.request_id) for r in spec]
        q = torch.zeros(len(spec), k, vocab, device=self.device)
        logits = self.model.logits(hidden[torch.tensor(ends, device=self.device)])
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
                hidden = graphs.replay_rows(rows, tables)
            else:
                hidden = self._run(SchedulerOutput(rows), prepare)
            logits = self.model.logits(hidden)
        return q

    def _mirrored(self, r: ScheduledRequest) -> ScheduledRequest:
        """The row's real tokens (no drafts), from one position earlier for a decode row
        whose last draft was accepted without the draft having computed it."""
        real = r.token_ids[: len(r.token_ids) - r.num_drafts]
        behind = r.request_id in self.behind
        self.behind.discard(r.request_id)
        before = _token_at(r, r.start_pos - 1) if behind and len(real) == 1 else None
        if before is None:
            return replace(r, token_ids=real)
        return replace(r, token_ids=[before, *real], start_pos=r.start_pos - 1)

    def verified(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """A row's verification: with every draft accepted, its next row recomputes the
        last one."""
        if num_accepted == num_drafts:
            self.behind.add(request_id)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states of a batch over the draft's own KV cache (what its graphs capture)."""
        hidden: torch.Tensor = self.model(input_ids, positions, self.kv_cache, meta)
        return hidden

    def _run(
        self,
        batch: SchedulerOutput,
        prepare: Prepare,
        patch: Callable[[torch.Tensor], object] | None = None,
    ) -> torch.Tensor:
        input_ids, positions, meta = prepare(batch)
        if patch is not None:
            patch(input_ids)
        return self.forward(input_ids, positions, meta)


def _draft_row(r: ScheduledRequest, j: int) -> ScheduledRequest:
    """Draft j (0-based) of the row as a one-token row at its position; rows with fewer
    drafts recompute their last one (harmless: the same KV again)."""
    at = min(j, r.num_drafts - 1)
    real = len(r.token_ids) - r.num_drafts
    return replace(r, token_ids=[r.token_ids[real + at]], start_pos=r.start_pos + real + at)


def _token_at(r: ScheduledRequest, position: int) -> int | None:
    """The row's token at `position`; None where its history has none (position -1, or
    the warm-up's synthetic rows)."""
    prompt = len(r.prompt_token_ids)
    if 0 <= position < prompt:
        return r.prompt_token_ids[position]
    if 0 <= position - prompt < len(r.output_token_ids):
        return r.output_token_ids[position - prompt]
    return None
