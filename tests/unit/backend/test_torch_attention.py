"""The CPU attention path: decode rows attended in length-sorted groups, one SDPA call
per group, give what the one-call-per-sequence path gives, wherever the decode rows sit
in the batch and however they are grouped."""

from __future__ import annotations

import pytest
import torch

from backend import attention_metadata
from backend.attention_metadata import AttentionMetadata
from backend.layers.attention import TorchPagedAttention, _attend_one

HEADS = [(4, 4), (8, 2), (8, 1)]
# (context length, new tokens): decode rows between prefills and chunks, so they are
# neither the leading rows nor contiguous.
SEQS = [(70, 70), (37, 1), (150, 40), (300, 1), (5, 1), (33, 2), (129, 1), (16, 1), (1, 1)]
DECODES = [(37, 1), (300, 1), (5, 1), (129, 1), (16, 1), (1, 1)]  # not sorted by length


def _batch(
    heads: int, kv_heads: int, block_size: int, seqs: list[tuple[int, int]] = SEQS
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    gen = torch.Generator().manual_seed(heads * block_size)
    widths = [-(-length // block_size) for length, _ in seqs]
    num_blocks = sum(widths) + 4
    kv_cache = torch.randn(2, num_blocks, block_size, kv_heads, 32, generator=gen)
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    tables, taken = [], 0
    for width in widths:
        tables.append(pool[taken : taken + width] + [0] * (max(widths) - width))
        taken += width
    starts = [0]
    for _, new in seqs:
        starts.append(starts[-1] + new)
    q = torch.randn(starts[-1], heads, 32, generator=gen)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64),
        block_tables=torch.tensor(tables),
        seq_lens=[length for length, _ in seqs],
        query_start_loc=starts,
        block_size=block_size,
    )
    return q, kv_cache, meta


@pytest.mark.parametrize("group_tokens", [1, 400, 10**6])  # per row, several, all in one
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize(("heads", "kv_heads"), HEADS)
def test_grouped_decode_equals_one_call_per_sequence(
    monkeypatch: pytest.MonkeyPatch, heads: int, kv_heads: int, block_size: int, group_tokens: int
) -> None:
    monkeypatch.setattr(attention_metadata, "DECODE_GROUP_TOKENS", group_tokens)
    q, kv_cache, meta = _batch(heads, kv_heads, block_size)
    groups = meta.decode_groups
    decodes = [i for i, (_, new) in enumerate(SEQS) if new == 1]
    grouped = sorted(int(r) for g in groups if g.rows is not None for r in g.rows)
    assert grouped == [meta.query_start_loc[i] for i in decodes]  # every decode row, once
    expected_groups = {1: len(decodes), 10**6: 1}.get(group_tokens)
    assert expected_groups is None or len(groups) == expected_groups
    assert 1 < len(groups) < len(decodes) or expected_groups is not None
    got = TorchPagedAttention().attend(q, kv_cache, meta, scale=0.2)
    want = torch.empty_like(q)
    for i in range(len(SEQS)):
        _attend_one(q, kv_cache, meta, 0.2, i, want)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize(("heads", "kv_heads"), HEADS)
def test_a_decode_only_batch_in_one_group_equals_one_call_per_sequence(
    heads: int, kv_heads: int, block_size: int, dtype: torch.dtype
) -> None:
    q, kv_cache, meta = _batch(heads, kv_heads, block_size, DECODES)
    q, kv_cache = q.to(dtype), kv_cache.to(dtype)
    [group] = meta.decode_groups
    assert group.rows is None  # attended in batch order: no gather, no scatter
    got = TorchPagedAttention().attend(q, kv_cache, meta, scale=0.2)
    want = torch.empty_like(q)
    for i in range(len(DECODES)):
        _attend_one(q, kv_cache, meta, 0.2, i, want)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


# Verify rows (a token and its drafts) over cached keys, at and off block boundaries,
# beside decode rows and a chunk too long for the short path.
SHORT = [(37, 5), (16, 5), (300, 1), (64, 16), (17, 3), (150, 40), (6, 2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize(("heads", "kv_heads"), HEADS)
def test_short_rows_attend_as_one_call_per_sequence(
    heads: int, kv_heads: int, block_size: int, dtype: torch.dtype
) -> None:
    q, kv_cache, meta = _batch(heads, kv_heads, block_size, SHORT)
    q, kv_cache = q.to(dtype), kv_cache.to(dtype)
    assert sorted(meta.short_query_bias) == [0, 1, 3, 4, 6]  # not the decode row or the chunk
    got = TorchPagedAttention().attend(q, kv_cache, meta, scale=0.2)
    want = torch.empty_like(q)
    for i in range(len(SHORT)):
        _attend_one(q, kv_cache, meta, 0.2, i, want)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
