"""What attention needs to know about one flat batch, built by the model runner once per
step and read by every layer and both attention backends (backend/layers/attention.py's
torch one and backend/kernels' Triton one): its own module, so neither backend imports
the other's."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from functools import cached_property

import torch

from backend.config import SHORT_QUERY_TOKENS


@dataclass(frozen=True)
class AttentionMetadata:
    """Describes one flat batch: sequence i owns query rows
    query_start_loc[i]:query_start_loc[i+1] and has seq_lens[i] tokens of context
    (cached + new) stored in the blocks block_tables[i].

    The lengths come twice: as lists for host-side decisions and as tensors on the
    model's device for kernels. The runner builds both from one host-to-device copy;
    tensors left out are made from the lists."""

    slot_mapping: torch.Tensor  # [T] int64, cache slot (block * block_size + offset) per token
    block_tables: torch.Tensor  # [B, max_blocks] int32 (or int64), past a row's blocks unread
    seq_lens: list[int]  # [B]
    query_start_loc: list[int]  # [B + 1]
    block_size: int
    seq_lens_tensor: torch.Tensor | None = None  # [B] on the device; None: from the list
    query_start_tensor: torch.Tensor | None = None  # [B + 1] on the device
    # A CUDA graph's decode step: the host lengths are placeholders, and choices a replay
    # freezes (the split into segments) are made for any context.
    captured: bool = False
    max_query_len: int = field(init=False)
    max_seq_len: int = field(init=False)
    decode_seqs: list[int] = field(init=False)  # sequences with one new token
    prefill_seqs: list[int] = field(init=False)  # the others: prompts, chunks, recompute

    def __post_init__(self) -> None:
        starts, device = self.query_start_loc, self.slot_mapping.device
        if self.seq_lens_tensor is None:
            object.__setattr__(self, "seq_lens_tensor", torch.tensor(self.seq_lens, device=device))
        if self.query_start_tensor is None:
            object.__setattr__(self, "query_start_tensor", torch.tensor(starts, device=device))
        num_new = [b - a for a, b in itertools.pairwise(starts)]
        object.__setattr__(self, "max_query_len", max(num_new, default=0))
        object.__setattr__(self, "max_seq_len", max(self.seq_lens, default=0))
        object.__setattr__(self, "decode_seqs", [i for i, n in enumerate(num_new) if n == 1])
        object.__setattr__(self, "prefill_seqs", [i for i, n in enumerate(num_new) if n != 1])

    @cached_property
    def decode_groups(self) -> list[DecodeGroup]:
        """The decode rows in groups of similar length, gathered once per step for every
        layer: sorted by length and cut where a group's padded keys would pass
        DECODE_GROUP_TOKENS, so little is padded and each group's K/V stays small enough
        to be reused from the CPU caches by SDPA (one big gather of every row is slower
        than one call per sequence). A decode-only batch that fits one group is that
        group in batch order (`DecodeGroup.rows` None: no gather of q, no scatter back)."""
        groups: list[list[int]] = []
        for i in sorted(self.decode_seqs, key=self.seq_lens.__getitem__):
            if not groups or (len(groups[-1]) + 1) * self.seq_lens[i] > DECODE_GROUP_TOKENS:
                groups.append([])
            groups[-1].append(i)
        if len(groups) == 1 and not self.prefill_seqs:
            return [DecodeGroup.build(self, self.decode_seqs, whole_batch=True)]
        return [DecodeGroup.build(self, seqs) for seqs in groups]

    @cached_property
    def short_query_bias(self) -> dict[int, torch.Tensor]:
        """Sequences with a few new tokens over cached keys (a verify row: its last token
        and its drafts; a short catch-up) -> [n, width * block_size] additive bias: query
        j, at position seq_len - n + j, sees the keys up to it. Built once per step for
        every layer; the torch backend attends such a row in one SDPA call over its
        blocks, as a decode row (a prompt's path cost twice a decode row's per layer)."""
        found = {}
        for i in self.prefill_seqs:
            n = self.query_start_loc[i + 1] - self.query_start_loc[i]
            seq_len = self.seq_lens[i]
            if n > SHORT_QUERY_TOKENS or n == seq_len:
                continue
            device = self.block_tables.device
            keys = torch.arange(-(-seq_len // self.block_size) * self.block_size, device=device)
            hidden = keys[None, :] > torch.arange(seq_len - n, seq_len, device=device)[:, None]
            found[i] = torch.zeros(hidden.shape, device=device).masked_fill_(hidden, -torch.inf)
        return found


DECODE_GROUP_TOKENS = 2048  # timed on the 8-layer 512-wide bench Llama: beat 4,096 and "all"


@dataclass(frozen=True)
class DecodeGroup:
    """Decode rows (one query each) attended in one SDPA call: which query rows they are,
    their KV blocks in one flat index (padded to the longest), which keys each row sees."""

    rows: torch.Tensor | None  # [D] the rows of q; None: every row, in order
    blocks: torch.Tensor  # [D * width] block ids, row by row
    # [D, 1, 1, width * block_size]: 0 where key position < seq_len, else -inf (an
    # additive mask: SDPA would turn a boolean one into this in every layer)
    bias: torch.Tensor

    @staticmethod
    def build(meta: AttentionMetadata, seqs: list[int], whole_batch: bool = False) -> DecodeGroup:
        lens = [meta.seq_lens[i] for i in seqs]
        width = -(-max(lens) // meta.block_size)
        device = meta.block_tables.device
        table = meta.block_tables
        if not whole_batch:
            table = table.index_select(0, torch.tensor(seqs, device=device))
        positions = torch.arange(width * meta.block_size, device=device)
        hidden = positions >= torch.tensor(lens, device=device)[:, None]
        bias = torch.zeros(hidden.shape, device=device).masked_fill_(hidden, float("-inf"))
        rows = None if whole_batch else [meta.query_start_loc[i] for i in seqs]
        return DecodeGroup(
            rows=None if rows is None else torch.tensor(rows, device=device),
            blocks=table[:, :width].flatten(),
            bias=bias[:, None, None, :],
        )
