"""Attention over a paged KV cache.

The model only sees `AttentionBackend`: write this step's K/V into cache slots, then attend
from this step's queries over each sequence's cached keys. `TorchPagedAttention` is the
readable reference and the CPU path; `TritonPagedAttention` (backend/kernels) implements
the same two methods with Triton kernels. `attention_backend` picks one."""

from __future__ import annotations

import os
from typing import Protocol

import torch
from torch.nn import functional

from backend.attention_metadata import AttentionMetadata, DecodeGroup
from backend.config import ATTENTION_BACKENDS
from backend.kernels import triton_available
from backend.layers import kv_quant


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
    length (AttentionMetadata.decode_groups), then one per prefilling sequence (a
    short one, such as a verify row, as a decode row of several queries). Query j
    of a sequence with n new tokens sits at position seq_len - n + j and sees every key
    up to it: cached blocks (an earlier chunk, a prefix-cache hit, a preempted request's
    recomputed part) and this step's keys alike."""

    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        if kv_quant.is_quantized(kv_cache):
            kv_quant.write(k, kv_cache[0], meta.slot_mapping)
            kv_quant.write(v, kv_cache[1], meta.slot_mapping)
            return
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
        short = meta.short_query_bias
        for i in meta.prefill_seqs:
            if i in short:
                _attend_short(q, kv_cache, meta, scale, i, out)
            else:
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
    k = _blocks(kv_cache[0], d.blocks, q.dtype).view(num, length, kv_heads, dim).transpose(1, 2)
    v = _blocks(kv_cache[1], d.blocks, q.dtype).view(num, length, kv_heads, dim).transpose(1, 2)
    qg = q.view(num, kv_heads, heads // kv_heads, dim)
    bias = d.bias.to(q.dtype)  # as SDPA's CUDA kernels want it; free in float32
    o = functional.scaled_dot_product_attention(qg, k, v, attn_mask=bias, scale=scale)
    return o.reshape(num, heads, dim)


def _attend_short(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    i: int,
    out: torch.Tensor,
) -> None:
    """A row of a few new tokens as a decode row of n queries: its whole blocks gathered
    once, its [n * group] queries per KV head against them, `short_query_bias` masking
    each query's future (and the last block's unused slots)."""
    start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
    n, heads, dim = end - start, q.shape[1], q.shape[2]
    bias = meta.short_query_bias[i]
    kv_heads, length = kv_cache.shape[-2], bias.shape[-1]
    group = heads // kv_heads
    blocks = meta.block_tables[i, : length // meta.block_size]
    k = _blocks(kv_cache[0], blocks, q.dtype).view(1, length, kv_heads, dim).transpose(1, 2)
    v = _blocks(kv_cache[1], blocks, q.dtype).view(1, length, kv_heads, dim).transpose(1, 2)
    # Rows query-major within each KV head: row j * group + g is query j's head g.
    qg = q[start:end].view(n, kv_heads, group, dim).transpose(0, 1).reshape(1, kv_heads, -1, dim)
    mask = bias.to(q.dtype).repeat_interleave(group, 0)
    o = functional.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
    out[start:end] = o.view(kv_heads, n, group, dim).transpose(0, 1).reshape(n, heads, dim)


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
    k = _gather(kv_cache[0], blocks, seq_len, q.dtype)[:, None].expand(shape)
    v = _gather(kv_cache[1], blocks, seq_len, q.dtype)[:, None].expand(shape)
    qg = q[start:end].view(n, kv_heads, group, dim).permute(1, 2, 0, 3)
    # A whole prompt is plain causal attention (SDPA skips the masked half itself); a
    # chunk over cached keys needs its offset mask.
    whole = n == seq_len
    mask = None if n == 1 or whole else _causal_mask(n, seq_len, q.device)
    o = functional.scaled_dot_product_attention(
        qg, k, v, attn_mask=mask, is_causal=whole and n > 1, scale=scale
    )
    out[start:end] = o.permute(2, 0, 1, 3).reshape(n, heads, dim)


def _blocks(cache: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The blocks' [n, block_size, kv_heads, dim] in `dtype` (index_select: several times
    faster than advanced indexing for this copy on CPU); a quantized cache is dequantized
    after the gather, so only the blocks read pay for it."""
    if kv_quant.is_quantized(cache):
        return kv_quant.read(cache, blocks, dtype)
    return cache.index_select(0, blocks)


def _gather(
    cache: torch.Tensor, blocks: torch.Tensor, seq_len: int, dtype: torch.dtype
) -> torch.Tensor:
    """[kv_heads, seq_len, dim] from the blocks."""
    return _blocks(cache, blocks, dtype).flatten(0, 1)[:seq_len].transpose(0, 1)


def _causal_mask(n: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """[n, seq_len]: query j (at position seq_len - n + j) sees keys 0..seq_len - n + j."""
    q_pos = torch.arange(seq_len - n, seq_len, device=device)
    return torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]
