"""Paged attention over a flat ragged batch, and its torch reference.

One kernel serves decode rows, whole prefills and prefill chunks over a cached prefix:
sequence i owns query rows query_start_loc[i]:query_start_loc[i+1] (n of them) and has
seq_lens[i] tokens of context, so its query j sits at position seq_lens[i] - n + j and sees
keys 0..that position. A program takes BLOCK_Q queries of one sequence times the query
heads sharing one KV head (GQA), so each K/V tile is read once per group, and walks the
sequence's keys tile by tile with an online softmax.

Split mode (flash-decoding) gives each program one of NUM_SEGMENTS contiguous ranges of
the key tiles; a second kernel merges the partial results by their log-sum-exp. It pays
when a few long sequences would otherwise leave most of the GPU idle.

A one-byte cache (int8, fp8: backend/layers/kv_quant.py) is dequantized as each tile is
loaded: values times their (token, KV head) float32 scale, then the compute dtype."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backend.layers import kv_quant


@triton.jit
def _find_sequence(query_start_ptr, num_seqs, q_block, BLOCK_Q: tl.constexpr):
    """The sequence owning program `q_block`: sequence i's programs start at
    query_start[i] // BLOCK_Q + i (an upper bound on the blocks before it, so no two
    sequences share one); binary search for the last start <= q_block."""
    lo = num_seqs * 0  # an int32 tensor like hi, so the loop-carried types agree
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_ptr + mid) // BLOCK_Q + mid
        if start <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# Triton compiles a variant per specialisation of its integer arguments (== 1, divisible
# by 16) and pointers (16-byte aligned). These two change from step to step; specialised,
# each new value class compiled a variant (0.4-0.8 s on a GPU) inside a timed step.
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    out_ptr,
    lse_ptr,
    scale,
    num_seqs,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_sb,
    stride_ss,
    stride_sh,
    stride_bt,
    stride_ot,
    stride_oh,
    stride_oseg,
    stride_lt,
    stride_lh,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    seq = _find_sequence(query_start_ptr, num_seqs, q_block, BLOCK_Q)
    q_start = tl.load(query_start_ptr + seq)
    num_new = tl.load(query_start_ptr + seq + 1) - q_start
    local = q_block - (q_start // BLOCK_Q + seq)  # this program's BLOCK_Q chunk of queries
    if local * BLOCK_Q >= num_new:
        return
    seq_len = tl.load(seq_lens_ptr + seq)

    # Rows: BLOCK_Q query tokens x GROUP_P query heads (padded to a power of two).
    rows = tl.arange(0, BLOCK_Q * GROUP_P)
    q_idx = local * BLOCK_Q + rows // GROUP_P
    head = kv_head * GROUP + rows % GROUP_P
    row_ok = (q_idx < num_new) & (rows % GROUP_P < GROUP)
    q_pos = seq_len - num_new + q_idx
    token = (q_start + q_idx).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM_P)
    dim_ok = dims < HEAD_DIM
    q_mask = row_ok[:, None] & dim_ok[None, :]
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=q_mask,
        other=0.0,
    )
    compute_dtype = q.dtype  # the model's: p is rounded to it below, as on the GPU
    q = q.to(DOT_DTYPE)

    # Keys up to the last query of this program; this segment's share of their tiles.
    kv_len = seq_len - num_new + tl.minimum((local + 1) * BLOCK_Q, num_new)
    num_tiles = tl.cdiv(kv_len, TILE)
    per_segment = tl.cdiv(num_tiles, NUM_SEGMENTS)
    tile_lo = segment * per_segment
    tile_hi = tl.minimum(tile_lo + per_segment, num_tiles)

    m = tl.full([BLOCK_Q * GROUP_P], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_Q * GROUP_P], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_P, HEAD_DIM_P], tl.float32)
    qk_scale = scale * 1.4426950408889634  # exp2 below: fold log2(e) into the scale
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(tile_lo, tile_hi):
        key_pos = tile * TILE + tl.arange(0, TILE)
        key_ok = key_pos < kv_len
        # int64 before the multiply: block * stride overflows int32 on a large pool.
        block = tl.load(table + key_pos // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        offset = key_pos % BLOCK_SIZE
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(
            k_cache_ptr
            + block[:, None] * stride_kb
            + offset[:, None] * stride_ks
            + kv_head * stride_kh
            + dims[None, :],
            mask=kv_mask,
            other=0.0,
        )
        v = tl.load(
            v_cache_ptr
            + block[:, None] * stride_vb
            + offset[:, None] * stride_vs
            + kv_head * stride_vh
            + dims[None, :],
            mask=kv_mask,
            other=0.0,
        )
        if KV_QUANT:
            scale_off = block * stride_sb + offset * stride_ss + kv_head * stride_sh
            k_scale = tl.load(k_scale_ptr + scale_off, mask=key_ok, other=0.0)
            v_scale = tl.load(v_scale_ptr + scale_off, mask=key_ok, other=0.0)
            k = (k.to(tl.float32) * k_scale[:, None]).to(compute_dtype)
            v = (v.to(tl.float32) * v_scale[:, None]).to(compute_dtype)
        k = k.to(DOT_DTYPE)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        visible = row_ok[:, None] & key_ok[None, :] & (key_pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        # A row that has seen no key yet keeps m = -inf; subtract 0 there, not -inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m - m_safe)
        l_sum = l_sum * alpha + tl.sum(p, 1)
        # p is rounded to the compute dtype as on the GPU, even where DOT_DTYPE is wider.
        p = p.to(compute_dtype, fp_downcast_rounding="rtne").to(DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p, v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        m = m_new

    empty = l_sum == 0.0  # padding rows, or a segment with no visible key
    l_safe = tl.where(empty, 1.0, l_sum)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m + tl.log2(l_safe)) * 0.6931471805599453)
    out_off = token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
    tl.store(
        out_ptr + out_off + segment * stride_oseg,
        out.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
        mask=q_mask,
    )
    tl.store(lse_ptr + token * stride_lt + head * stride_lh + segment, lse, mask=row_ok)


@triton.jit
def _merge_segments_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    lse_ptr,
    stride_pt,
    stride_ph,
    stride_pseg,
    stride_plt,
    stride_plh,
    stride_ot,
    stride_oh,
    stride_lt,
    stride_lh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
):
    """out = sum_s exp(lse_s - lse) * out_s with lse = log sum_s exp(lse_s)."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    segments = tl.arange(0, NUM_SEGMENTS)
    dims = tl.arange(0, HEAD_DIM_P)
    dim_ok = dims < HEAD_DIM
    lse_s = tl.load(part_lse_ptr + token * stride_plt + head * stride_plh + segments)
    m = tl.max(lse_s, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    weight = tl.exp(lse_s - m_safe)
    total = tl.sum(weight, 0)
    part = tl.load(
        part_out_ptr
        + token * stride_pt
        + head * stride_ph
        + segments[:, None] * stride_pseg
        + dims[None, :],
        mask=dim_ok[None, :],
        other=0.0,
    )
    total_safe = tl.where(total == 0.0, 1.0, total)
    out = tl.sum(part * weight[:, None], 0) / total_safe
    lse = tl.where(total == 0.0, float("-inf"), m_safe + tl.log(total_safe))
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
        mask=dim_ok,
    )
    tl.store(lse_ptr + token * stride_lt + head * stride_lh, lse)


_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def _interpreted() -> bool:
    """Triton's CPU interpreter multiplies 16-bit floats as raw integers in tl.dot, so
    there the dot operands are widened to float32 (after the same rounding of p)."""
    return type(_paged_attention_kernel).__name__ == "InterpretedFunction"


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    num_segments: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, heads, D]; k_cache, v_cache: [num_blocks, block_size, kv_heads, D] (any
    strides but a contiguous last dim) in q's dtype, or one byte a value with 4 scale
    bytes after each head's D (kv_quant's layout); block_tables: [B, max_blocks];
    seq_lens: [B]; query_start_loc: [B + 1]. Returns (out [T, heads, D] in q's dtype, lse
    [T, heads] float32, natural log). num_segments > 1 (a power of two) takes the split
    path."""
    tokens, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    quantized = kv_quant.is_quantized(k_cache)
    if quantized:
        (k_cache, k_scales), (v_cache, v_scales) = kv_quant.split(k_cache), kv_quant.split(v_cache)
    else:
        k_scales = v_scales = k_cache  # unread
    group = heads // kv_heads
    group_p = triton.next_power_of_2(group)
    # At least 16 rows per program (tl.dot's minimum); decode-only batches use the fewest.
    rows = 16 if max_query_len == 1 else 64
    block_q = max(1, rows // group_p)
    tile = max(32, block_size)
    num_seqs = seq_lens.shape[0]
    grid = (tokens // block_q + num_seqs, kv_heads, num_segments)
    out = torch.empty_like(q)
    lse = torch.empty(tokens, heads, dtype=torch.float32, device=q.device)
    if num_segments == 1:
        part_out, part_lse, seg_stride = out, lse, 0
    else:
        part_out = torch.empty(
            tokens, heads, num_segments, head_dim, dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty(tokens, heads, num_segments, dtype=torch.float32, device=q.device)
        seg_stride = part_out.stride(2)
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        k_scales,
        v_scales,
        block_tables,
        seq_lens,
        query_start_loc,
        part_out,
        part_lse,
        scale,
        num_seqs,
        q.stride(0),
        q.stride(1),
        *k_cache.stride()[:3],  # block, slot, head
        *v_cache.stride()[:3],
        *k_scales.stride()[:3],
        block_tables.stride(0),
        part_out.stride(0),
        part_out.stride(1),
        seg_stride,
        part_lse.stride(0),
        part_lse.stride(1),
        GROUP=group,
        GROUP_P=group_p,
        HEAD_DIM=head_dim,
        HEAD_DIM_P=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_Q=block_q,
        TILE=tile,
        NUM_SEGMENTS=num_segments,
        DOT_DTYPE=tl.float32 if _interpreted() else _TL_DTYPES[q.dtype],
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,  # None: the default
        KV_QUANT=quantized,
    )
    if num_segments > 1:
        _merge_segments_kernel[(tokens, heads)](
            part_out,
            part_lse,
            out,
            lse,
            part_out.stride(0),
            part_out.stride(1),
            part_out.stride(2),
            part_lse.stride(0),
            part_lse.stride(1),
            out.stride(0),
            out.stride(1),
            lse.stride(0),
            lse.stride(1),
            HEAD_DIM=head_dim,
            HEAD_DIM_P=triton.next_power_of_2(head_dim),
            NUM_SEGMENTS=num_segments,
        )
    return out, lse


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: list[int],
    query_start_loc: list[int],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same contract in plain torch, one sequence at a time, in float32: gather the
    sequence's keys by its block table, repeat them per query head, mask causally. A
    one-byte cache is dequantized first, to q's dtype as the kernel does."""
    if kv_quant.is_quantized(k_cache):
        k_cache, v_cache = (
            kv_quant.dequantize(k_cache, q.dtype),
            kv_quant.dequantize(v_cache, q.dtype),
        )
    heads = q.shape[1]
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], heads, dtype=torch.float32, device=q.device)
    for i, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        blocks = block_tables[i, : -(-seq_len // block_size)]
        k = k_cache[blocks].flatten(0, 1)[:seq_len].float().repeat_interleave(heads // kv_heads, 1)
        v = v_cache[blocks].flatten(0, 1)[:seq_len].float().repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), k) * scale
        q_pos = torch.arange(seq_len - (end - start), seq_len, device=q.device)
        hidden = torch.arange(seq_len, device=q.device)[None, :] > q_pos[:, None]
        scores = scores.masked_fill(hidden, float("-inf"))
        lse[start:end] = torch.logsumexp(scores, -1).transpose(0, 1)
        probs = torch.softmax(scores, -1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out, lse
