"""Attention over a paged KV cache.

The model only sees `AttentionBackend`: write this step's K/V into cache slots, then attend
from this step's queries over each sequence's cached keys. `TorchPagedAttention` is the
readable reference and the CPU path; `TritonPagedAttention` (backend/kernels) implements
the same two methods with Triton kernels. `attention_backend` picks one."""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

import torch
from torch.nn import functional

from backend.config import ATTENTION_BACKENDS
from backend.kernels import triton_available


@dataclass(frozen=True)
class AttentionMetadata:
    """Describes one flat batch: sequence i owns query rows
    query_start_loc[i]:query_start_loc[i+1] and has seq_lens[i] tokens of context
    (cached + new) stored in the blocks block_tables[i].

    The lengths come twice: as lists for host-side decisions and as tensors on the
    model's device for kernels. The runner builds both from one host-to-device copy;
    tensors left out are made from the lists."""

    slot_mapping: torch.Tensor  # [T] int64, cache slot (block * block_size + offset) per token
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with 0
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


class AttentionBackend(Protocol):
    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        """k, v: [T, kv_heads, head_dim]; kv_cache: [2, num_blocks, block_size, kv_heads, D]."""

    def attend(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """q: [T, heads, head_dim] -> [T, heads, head_dim], causal within each sequence."""


def attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """ "auto": Triton on CUDA, torch on the CPU. "triton" on the CPU runs only in Triton's
    interpreter (TRITON_INTERPRET=1, for tests): nothing compiles Triton for a CPU here."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    if name == "auto":
        name = "triton" if device.type == "cuda" and triton_available() else "torch"
    if name == "torch":
        return TorchPagedAttention()
    if not triton_available():
        raise ValueError("attention_backend 'triton' needs the triton package, not installed")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"attention_backend 'triton' needs a CUDA device, not {device.type!r} "
            "(on the CPU only under TRITON_INTERPRET=1, Triton's slow interpreter)"
        )
    # Imported here, not at the top: importing decorates the kernels, and whether they
    # are compiled or interpreted is fixed at that moment.
    from backend.kernels.triton_attention import TritonPagedAttention

    return TritonPagedAttention()


class TorchPagedAttention:
    """The CPU backend and reference: one SDPA call per group of decode rows of similar
    length (AttentionMetadata.decode_groups), then one per prefilling sequence. Query j
    of a sequence with n new tokens sits at position seq_len - n + j and sees every key
    up to it: cached blocks (an earlier chunk, a prefix-cache hit, a preempted request's
    recomputed part) and this step's keys alike."""

    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        k_cache.view(-1, *k.shape[1:]).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, *v.shape[1:]).index_copy_(0, meta.slot_mapping, v)

    def attend(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        groups = meta.decode_groups
        if len(groups) == 1 and groups[0].rows is None:  # decode only, in one group
            return _attend_decodes(q, kv_cache, groups[0], scale)
        out = torch.empty_like(q)
        for group in groups:
            assert group.rows is not None  # a whole-batch group is the only group
            rows = q.index_select(0, group.rows)
            out.index_copy_(0, group.rows, _attend_decodes(rows, kv_cache, group, scale))
        for i in meta.prefill_seqs:
            _attend_one(q, kv_cache, meta, scale, i, out)
        return out


def _attend_decodes(
    q: torch.Tensor, kv_cache: torch.Tensor, d: DecodeGroup, scale: float
) -> torch.Tensor:
    """A group's decode rows q [D, heads, dim] at once: [D, kv_heads, group, dim]
    queries (the query heads sharing a KV head are its `group` queries, so K/V are never
    repeated per head) against [D, kv_heads, L, dim] keys, keys past each row's length
    masked."""
    num, heads, dim = q.shape
    kv_heads, length = kv_cache.shape[-2], d.bias.shape[-1]
    # Two gathers along dim 0: torch parallelises those, not one along dim 1 of both.
    k = kv_cache[0].index_select(0, d.blocks).view(num, length, kv_heads, dim).transpose(1, 2)
    v = kv_cache[1].index_select(0, d.blocks).view(num, length, kv_heads, dim).transpose(1, 2)
    qg = q.view(num, kv_heads, heads // kv_heads, dim)
    bias = d.bias.to(q.dtype)  # as SDPA's CUDA kernels want it; free in float32
    o = functional.scaled_dot_product_attention(qg, k, v, attn_mask=bias, scale=scale)
    return o.reshape(num, heads, dim)


def _attend_one(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    i: int,
    out: torch.Tensor,
) -> None:
    start, end, seq_len = meta.query_start_loc[i], meta.query_start_loc[i + 1], meta.seq_lens[i]
    n, heads, dim = end - start, q.shape[1], q.shape[2]
    kv_heads = kv_cache.shape[-2]
    group = heads // kv_heads
    blocks = meta.block_tables[i, : -(-seq_len // meta.block_size)]
    # Grouped-query attention without copying K/V per query head: the query heads that
    # share a KV head form one batch row, the KV head is broadcast (stride 0).
    shape = (kv_heads, group, seq_len, dim)
    k = _gather(kv_cache[0], blocks, seq_len)[:, None].expand(shape)
    v = _gather(kv_cache[1], blocks, seq_len)[:, None].expand(shape)
    qg = q[start:end].view(n, kv_heads, group, dim).permute(1, 2, 0, 3)
    # A whole prompt is plain causal attention (SDPA skips the masked half itself); a
    # chunk over cached keys needs its offset mask.
    whole = n == seq_len
    mask = None if n == 1 or whole else _causal_mask(n, seq_len, q.device)
    o = functional.scaled_dot_product_attention(
        qg, k, v, attn_mask=mask, is_causal=whole and n > 1, scale=scale
    )
    out[start:end] = o.permute(2, 0, 1, 3).reshape(n, heads, dim)


def _gather(cache: torch.Tensor, blocks: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[kv_heads, seq_len, dim] from the blocks (index_select: several times faster than
    advanced indexing for this copy on CPU)."""
    return cache.index_select(0, blocks).flatten(0, 1)[:seq_len].transpose(0, 1)


def _causal_mask(n: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """[n, seq_len]: query j (at position seq_len - n + j) sees keys 0..seq_len - n + j."""
    q_pos = torch.arange(seq_len - n, seq_len, device=device)
    return torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]
