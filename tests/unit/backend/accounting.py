"""The block pool's books, checked from the outside after any sequence of operations."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from backend.engine.block_manager import BlockManager


def check_accounting(bm: BlockManager, owners: Iterable[str]) -> None:
    """`owners`: the requests that should hold blocks now (running ones)."""
    owners = set(owners)
    tables = {rid: bm.block_ids(rid) for rid in owners}
    assert set(bm._tables) <= owners, f"tables of gone requests: {set(bm._tables) - owners}"
    refs = Counter(b for table in tables.values() for b in table)
    assert all(len(t) == len(set(t)) for t in tables.values()), "a block twice in one table"
    used = cached = free = 0
    for block in bm.blocks:
        assert block.ref_count >= 0, f"negative ref count on block {block.block_id}"
        assert block.ref_count == refs[block.block_id], f"block {block.block_id} ref count"
        in_queue = block.block_id in bm._free
        assert in_queue == (block.ref_count == 0), f"block {block.block_id} free queue"
        if block.block_hash is not None:
            assert bm._cached[block.block_hash] == block.block_id
            assert len(block.token_ids) == bm.block_size
        if block.ref_count:
            used += 1
        elif block.block_hash is not None:
            cached += 1
        else:
            free += 1
    assert len(bm._cached) == sum(b.block_hash is not None for b in bm.blocks)
    assert used + cached + free == bm.num_blocks
    assert (bm.num_used_blocks, bm.num_cached_blocks) == (used, cached)
    assert bm.num_free_blocks == cached + free
