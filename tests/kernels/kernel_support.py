"""Ragged paged-attention batches over a shuffled block pool, for the kernel tests."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Batch:
    q: torch.Tensor  # [T, heads, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, kv_heads, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks], padded with random block ids
    seq_lens: list[int]
    query_start_loc: list[int]

    @property
    def max_query_len(self) -> int:
        starts = self.query_start_loc
        return max(b - a for a, b in itertools.pairwise(starts))

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor(self.seq_lens), torch.tensor(self.query_start_loc)


# (context length, new tokens): decode rows, whole prefills, chunks over a cached prefix.
MIXED = [(37, 1), (23, 23), (150, 40), (300, 1), (5, 1), (70, 70), (33, 2)]
DECODE = [(330, 1), (33, 1), (1, 1), (129, 1)]  # 330: 21 blocks of 16, split 8 ways


def make_batch(
    seqs: list[tuple[int, int]],
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Batch:
    """Every sequence's blocks are drawn from one shuffled pool of spare blocks."""
    gen = torch.Generator().manual_seed(seed)
    widths = [-(-length // block_size) for length, _ in seqs]
    num_blocks = sum(widths) + 8
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    pool = torch.randperm(num_blocks, generator=gen)
    tables = _tables(pool, widths, num_blocks, gen)
    return _batch(seqs, heads, head_dim, dtype, gen, k_cache, v_cache, tables)


def _tables(
    pool: torch.Tensor, widths: list[int], num_blocks: int, gen: torch.Generator
) -> torch.Tensor:
    # Padding holds real block ids, so a kernel that reads past a table's end is wrong.
    tables = torch.randint(0, num_blocks, (len(widths), max(widths) + 2), generator=gen)
    taken = 0
    for i, width in enumerate(widths):
        tables[i, :width] = pool[taken : taken + width]
        taken += width
    return tables


def _batch(
    seqs: list[tuple[int, int]],
    heads: int,
    head_dim: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
) -> Batch:
    starts = [0]
    for _, new in seqs:
        starts.append(starts[-1] + new)
    q = torch.randn(starts[-1], heads, head_dim, generator=gen).to(dtype)
    return Batch(q, k_cache, v_cache, tables, [length for length, _ in seqs], starts)


def huge_pool_batch(dtype: torch.dtype = torch.bfloat16) -> Batch:
    """8 query heads over 1 KV head of dim 64, block size 16: a block is 1,024 elements,
    so any block id >= 2**21 puts its offset past int32. The pool has 2**21 + 64 blocks
    (4 GiB of address space in bfloat16) but only the blocks the tables name are written,
    so only their pages are ever backed by memory. K and V are two views of one pool,
    one block apart."""
    block_size, kv_heads, head_dim = 16, 1, 64
    num_blocks = 2**31 // (block_size * kv_heads * head_dim) + 64
    pool = torch.empty(num_blocks + 1, block_size, kv_heads, head_dim, dtype=dtype)
    k_cache, v_cache = pool[:-1], pool[1:]
    gen = torch.Generator().manual_seed(7)
    seqs = [(40, 1), (50, 20), (33, 1)]
    high = num_blocks - 60 + torch.randperm(58, generator=gen)  # past the int32 limit
    low = torch.randperm(1000, generator=gen)
    ids = [
        high[:3],
        torch.stack([low[0], high[3], low[1], high[4]]),
        torch.stack([high[5], *low[2:4]]),
    ]
    tables = torch.zeros(len(seqs), 4, dtype=torch.int32)
    for i, row in enumerate(ids):
        tables[i, : len(row)] = row
        pool[row] = torch.randn(len(row), *pool.shape[1:], generator=gen).to(dtype)
        pool[row + 1] = torch.randn(len(row), *pool.shape[1:], generator=gen).to(dtype)
    return _batch(seqs, 8, head_dim, dtype, gen, k_cache, v_cache, tables)
