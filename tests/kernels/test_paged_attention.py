"""The Triton paged-attention and KV-write kernels against their torch references, under
the interpreter: ragged batches (decode rows, whole prefills, chunks over a cached
prefix) over shuffled block tables, GQA shapes, both block sizes and head dims, the split
(flash-decoding) and unsplit paths, output and log-sum-exp, and block ids past int32."""

from __future__ import annotations

import pytest
import torch

from backend.kernels.kv_cache import write_kv, write_kv_reference
from backend.kernels.paged_attention import paged_attention, paged_attention_reference
from tests.kernels.kernel_support import DECODE, MIXED, Batch, huge_pool_batch, make_batch

pytestmark = pytest.mark.interpreter

# GQA groups of 1, 4 and 8 query heads, and of 3 (padded to 4, as in Llama 3.2 3B: 24/8)
HEADS = [(4, 4), (8, 2), (8, 1), (12, 4)]
TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (1.5e-2, 1e-2)}  # atol, rtol


def check(batch: Batch, num_segments: int) -> None:
    seq_lens, starts = batch.tensors()
    scale = batch.q.shape[-1] ** -0.5
    out, lse = paged_attention(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        seq_lens,
        starts,
        scale,
        batch.max_query_len,
        num_segments,
    )
    ref_out, ref_lse = paged_attention_reference(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        scale,
    )
    atol, rtol = TOLERANCE[batch.q.dtype]
    torch.testing.assert_close(out, ref_out, atol=atol, rtol=rtol)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)


# Every (head dim, block size) pair meets every head shape, across the two dtypes.
@pytest.mark.parametrize(("head_dim", "block_size"), [(64, 16), (128, 32)])
@pytest.mark.parametrize(("heads", "kv_heads"), HEADS)
def test_float32_mixed_batch_and_both_decode_paths(
    heads: int, kv_heads: int, head_dim: int, block_size: int
) -> None:
    check(make_batch(MIXED, heads, kv_heads, head_dim, block_size, seed=heads + head_dim), 1)
    decode = make_batch(DECODE, heads, kv_heads, head_dim, block_size, seed=block_size)
    check(decode, 1)
    check(decode, 8)


@pytest.mark.parametrize(("head_dim", "block_size"), [(64, 32), (128, 16)])
@pytest.mark.parametrize(("heads", "kv_heads"), HEADS)
def test_bfloat16_mixed_batch_and_both_decode_paths(
    heads: int, kv_heads: int, head_dim: int, block_size: int
) -> None:
    dtype = torch.bfloat16
    check(make_batch(MIXED, heads, kv_heads, head_dim, block_size, dtype, seed=heads), 1)
    decode = make_batch(DECODE, heads, kv_heads, head_dim, block_size, dtype, seed=3)
    check(decode, 1)
    check(decode, 4)


def test_split_path_over_prefill_rows_too() -> None:
    """Segments a causal query never reaches are empty (lse -inf) and must merge away."""
    check(make_batch(MIXED, 8, 2, 64, 16, seed=11), 4)


@pytest.mark.parametrize("num_segments", [1, 4])
def test_block_ids_past_int32_offsets(num_segments: int) -> None:
    batch = huge_pool_batch()
    assert batch.block_tables.dtype == torch.int32  # the multiply must widen it first
    assert int(batch.block_tables.max()) * batch.k_cache.stride(0) > 2**31
    check(batch, num_segments)


def _write_case(
    num_blocks: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(num_blocks)
    k, v = torch.randn(2, 9, 2, 64, generator=gen).to(dtype)
    slots = torch.randint(0, num_blocks * 16, (9,), generator=gen)
    slots[[2, 7]] = -1  # padding: not stored
    return k, v, slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_reference_and_skips_padding(dtype: torch.dtype) -> None:
    k, v, slots = _write_case(12, dtype)
    cache = torch.randn(2, 12, 16, 2, 64).to(dtype)
    expected = cache.clone()
    write_kv(k, v, cache[0], cache[1], slots)
    write_kv_reference(k, v, expected[0], expected[1], slots)
    assert torch.equal(cache, expected)
    written = cache[0].view(-1, 2, 64)[slots[slots >= 0]]
    assert torch.equal(written, k[slots >= 0])


def test_write_kv_past_int32_offsets() -> None:
    """A 4 GiB pool of address space whose pages are backed only where written; K and V
    are two views of it one block apart, so the slots written sit in distinct blocks."""
    num_blocks = 2**31 // (16 * 2 * 64) + 16
    pool = torch.empty(num_blocks + 1, 16, 2, 64, dtype=torch.bfloat16)
    k_cache, v_cache = pool[:-1], pool[1:]
    k, v, slots = _write_case(num_blocks, torch.bfloat16)
    slots[0] = (num_blocks - 1) * 16 + 5  # in the pool's last block
    kept = slots >= 0
    blocks = (slots[kept] // 16).sort().values
    assert bool((blocks.diff() > 1).all())  # no write lands in another's V (or K) block
    write_kv(k, v, k_cache, v_cache, slots.to(torch.int32))  # widened in the kernel
    assert torch.equal(k_cache.reshape(-1, 2, 64)[slots[kept]], k[kept])
    assert torch.equal(v_cache.reshape(-1, 2, 64)[slots[kept]], v[kept])


@pytest.mark.parametrize("num_segments", [1, 4])
def test_padding_rows_give_zeros_not_nan(num_segments: int) -> None:
    """A padded decode row (seq_len 0, as a CUDA-graph batch padded to its captured size
    carries) sees no key: its output is 0 and its lse -inf, and the real rows are intact."""
    batch = make_batch([(40, 1), (9, 1), (1, 1)], 8, 2, 64, 16, seed=2)
    seq_lens, starts = batch.tensors()
    seq_lens[2] = 0
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, seq_lens, starts, 0.125)
    out, lse = paged_attention(*args, 1, num_segments)
    assert bool((out[2] == 0).all()) and bool(torch.isneginf(lse[2]).all())
    ref, ref_lse = paged_attention_reference(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, [40, 9], [0, 1, 2], 0.125
    )
    torch.testing.assert_close(out[:2], ref[:2], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse[:2], ref_lse[:2], atol=1e-4, rtol=1e-4)
