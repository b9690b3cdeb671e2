"""Attention over a paged KV cache.

The model only sees `AttentionBackend`: write this step's K/V into cache slots, then attend
from this step's queries over each sequence's cached keys. `TorchPagedAttention` is the
readable reference and the CPU path; `TritonPagedAttention` (backend/kernels) implements
the same two methods with Triton kernels. `attention_backend` picks one."""

from __future__ import annotations

import importlib.util
import itertools
import os
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch.nn import functional

from backend.config import ATTENTION_BACKENDS


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
    max_query_len: int = field(init=False)
    max_seq_len: int = field(init=False)

    def __post_init__(self) -> None:
        starts, device = self.query_start_loc, self.slot_mapping.device
        if self.seq_lens_tensor is None:
            object.__setattr__(self, "seq_lens_tensor", torch.tensor(self.seq_lens, device=device))
        if self.query_start_tensor is None:
            object.__setattr__(self, "query_start_tensor", torch.tensor(starts, device=device))
        max_query = max((b - a for a, b in itertools.pairwise(starts)), default=0)
        object.__setattr__(self, "max_query_len", max_query)
        object.__setattr__(self, "max_seq_len", max(self.seq_lens, default=0))


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
        name = "triton" if device.type == "cuda" and _have_triton() else "torch"
    if name == "torch":
        return TorchPagedAttention()
    if not _have_triton():
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


def _have_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


class TorchPagedAttention:
    """Reference backend: gathers each sequence's blocks and calls SDPA, one sequence at a
    time. Query j of a sequence with n new tokens sits at position seq_len - n + j and sees
    every key up to it: cached blocks (an earlier chunk, a prefix-cache hit, a preempted
    request's recomputed part) and this step's keys alike."""

    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        k_cache.view(-1, *k.shape[1:]).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, *v.shape[1:]).index_copy_(0, meta.slot_mapping, v)

    def attend(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        out = torch.empty_like(q)
        for i in range(len(meta.seq_lens)):
            _attend_one(q, kv_cache, meta, scale, i, out)
        return out


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
    mask = None if n == 1 else _causal_mask(n, seq_len, q.device)
    o = functional.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
    out[start:end] = o.permute(2, 0, 1, 3).reshape(n, heads, dim)


def _gather(cache: torch.Tensor, blocks: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[kv_heads, seq_len, dim] from the blocks (index_select: several times faster than
    advanced indexing for this copy on CPU)."""
    return cache.index_select(0, blocks).flatten(0, 1)[:seq_len].transpose(0, 1)


def _causal_mask(n: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """[n, seq_len]: query j (at position seq_len - n + j) sees keys 0..seq_len - n + j."""
    q_pos = torch.arange(seq_len - n, seq_len, device=device)
    return torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]
