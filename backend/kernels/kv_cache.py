"""Writing this step's K/V into the paged cache by slot, and its torch reference. A
one-byte cache (int8, fp8: backend/layers/kv_quant.py) is quantized here, one float32
scale per token and KV head written beside the values."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backend.layers import kv_quant


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kb,
    stride_ks,
    stride_kch,
    stride_vb,
    stride_vs,
    stride_vch,
    stride_sb,
    stride_ss,
    stride_sh,
    KV_HEADS: tl.constexpr,
    KV_HEADS_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUANT_MAX: tl.constexpr,
):
    """One program per token: its [kv_heads, head_dim] K and V into slot
    (block * BLOCK_SIZE + offset); a slot of -1 (padding) is skipped. QUANT_MAX > 0: the
    cache is one byte a value (127: int8, 448: fp8), each head's row scaled by its peak."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, KV_HEADS_P)
    dims = tl.arange(0, HEAD_DIM_P)
    mask = (heads[:, None] < KV_HEADS) & (dims[None, :] < HEAD_DIM)
    # Padding lanes read as 0: they must not count in a quantized row's peak.
    k = tl.load(
        k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask, other=0.0
    )
    v = tl.load(
        v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask, other=0.0
    )
    k_dst = k_cache_ptr + block * stride_kb + offset * stride_ks
    v_dst = v_cache_ptr + block * stride_vb + offset * stride_vs
    if QUANT_MAX > 0:
        scale_off = block * stride_sb + offset * stride_ss + heads * stride_sh
        k = _quantize_rows(k, k_scale_ptr + scale_off, heads < KV_HEADS, QUANT_MAX, k_cache_ptr)
        v = _quantize_rows(v, v_scale_ptr + scale_off, heads < KV_HEADS, QUANT_MAX, v_cache_ptr)
    tl.store(k_dst + heads[:, None] * stride_kch + dims[None, :], k, mask=mask)
    tl.store(v_dst + heads[:, None] * stride_vch + dims[None, :], v, mask=mask)


@triton.jit
def _quantize_rows(x, scale_ptrs, head_ok, QUANT_MAX: tl.constexpr, cache_ptr):
    """x [heads, dims] -> values in the cache's dtype; each row's scale (its peak over
    QUANT_MAX, 1 for a row of zeros) stored at scale_ptrs."""
    x = x.to(tl.float32)
    peak = tl.max(tl.abs(x), 1)
    scale = tl.where(peak > 0, peak / QUANT_MAX, 1.0)
    tl.store(scale_ptrs, scale, mask=head_ok)
    scaled = tl.clamp(x / scale[:, None], -QUANT_MAX, QUANT_MAX)
    if cache_ptr.dtype.element_ty == tl.int8:
        # Half away from zero (torch rounds half to even: the two differ on exact halves).
        scaled = tl.where(scaled >= 0, tl.floor(scaled + 0.5), tl.ceil(scaled - 0.5))
        return scaled.to(tl.int8)
    return scaled.to(cache_ptr.dtype.element_ty, fp_downcast_rounding="rtne")  # as torch


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k, v: [T, kv_heads, D] (contiguous last dim); caches: [num_blocks, block_size,
    kv_heads, D (+ 4 scale bytes when one byte a value)]; slot_mapping: [T], -1 for a
    token that is not stored."""
    tokens, kv_heads, head_dim = k.shape
    if tokens == 0:
        return
    quantized = kv_quant.is_quantized(k_cache)
    if quantized:
        (k_cache, k_scales), (v_cache, v_scales) = kv_quant.split(k_cache), kv_quant.split(v_cache)
    else:
        k_scales = v_scales = k_cache  # unread
    _write_kv_kernel[(tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        k_scales,
        v_scales,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        *k_cache.stride()[:3],  # block, slot, head
        *v_cache.stride()[:3],
        *k_scales.stride()[:3],
        KV_HEADS=kv_heads,
        KV_HEADS_P=triton.next_power_of_2(kv_heads),
        HEAD_DIM=head_dim,
        HEAD_DIM_P=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
        QUANT_MAX=kv_quant.LIMITS[k_cache.dtype] if quantized else 0.0,
    )


def write_kv_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    keep = slot_mapping >= 0
    if kv_quant.is_quantized(k_cache):
        kv_quant.write(k[keep], k_cache, slot_mapping[keep])
        kv_quant.write(v[keep], v_cache, slot_mapping[keep])
        return
    slots = slot_mapping[keep]
    k_cache.view(-1, *k.shape[1:])[slots] = k[keep]
    v_cache.view(-1, *v.shape[1:])[slots] = v[keep]
