"""Attention over a paged KV cache.

The model only sees `AttentionBackend`: write this step's K/V into cache slots, then attend
from this step's queries over each sequence's cached keys. `TorchPagedAttention` is the
readable reference; a Triton backend implements the same two methods."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch.nn import functional


@dataclass(frozen=True)
class AttentionMetadata:
    """Describes one flat batch: sequence i owns query rows
    query_start_loc[i]:query_start_loc[i+1] and has seq_lens[i] tokens of context
    (cached + new) stored in the blocks block_tables[i]."""

    slot_mapping: torch.Tensor  # [T] int64, cache slot (block * block_size + offset) per token
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with 0
    seq_lens: list[int]  # [B]
    query_start_loc: list[int]  # [B + 1]
    block_size: int


class AttentionBackend(Protocol):
    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        """k, v: [T, kv_heads, head_dim]; kv_cache: [2, num_blocks, block_size, kv_heads, D]."""

    def attend(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """q: [T, heads, head_dim] -> [T, heads, head_dim], causal within each sequence."""


class TorchPagedAttention:
    """Reference backend: gathers each sequence's blocks and calls SDPA, one sequence at a time."""

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
        group = q.shape[1] // kv_cache.shape[-2]
        for i, seq_len in enumerate(meta.seq_lens):
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            blocks = meta.block_tables[i, : -(-seq_len // meta.block_size)]
            k = kv_cache[0][blocks].flatten(0, 1)[:seq_len].repeat_interleave(group, dim=1)
            v = kv_cache[1][blocks].flatten(0, 1)[:seq_len].repeat_interleave(group, dim=1)
            # Query j sits at position seq_len - n + j and sees keys up to that position.
            n = end - start
            q_pos = torch.arange(seq_len - n, seq_len, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
            o = functional.scaled_dot_product_attention(
                q[start:end].transpose(0, 1),
                k.transpose(0, 1),
                v.transpose(0, 1),
                attn_mask=mask,
                scale=scale,
            )
            out[start:end] = o.transpose(0, 1)
        return out
