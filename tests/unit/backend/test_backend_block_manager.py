"""The block pool: no block is ever owned twice or lost."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from backend.engine.block_manager import BlockManager


def check(bm: BlockManager, owners: set[str]) -> None:
    owned = [b for rid in owners for b in bm.block_ids(rid)]
    assert len(owned) == len(set(owned)) == bm.num_used_blocks
    assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
    assert all(bm.blocks[b].ref_count == 1 for b in owned)


def test_allocation_grows_the_table_and_none_means_no_room() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    assert bm.allocate_slots("a", 5) == [0, 1]
    assert bm.allocate_slots("a", 8) == []
    assert bm.allocate_slots("a", 9) == [2]
    assert bm.allocate_slots("b", 8) is None
    assert bm.block_ids("b") == [] and bm.num_free_blocks == 1
    bm.free("a")
    bm.free("a")
    bm.free("unknown")
    assert bm.num_free_blocks == 4
    assert bm.allocate_slots("b", 16) is not None


@given(
    st.lists(
        st.tuples(st.sampled_from(["alloc", "free"]), st.integers(0, 5), st.integers(1, 40)),
        max_size=60,
    )
)
def test_random_operations_keep_the_books(ops: list[tuple[str, int, int]]) -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    owners: set[str] = set()
    sizes: dict[str, int] = {}
    for op, who, tokens in ops:
        rid = f"r{who}"
        if op == "free":
            bm.free(rid)
            owners.discard(rid)
            sizes.pop(rid, None)
        else:
            want = max(tokens, sizes.get(rid, 0))
            before = bm.num_free_blocks
            new = bm.allocate_slots(rid, want)
            if new is None:
                assert bm.num_free_blocks == before
            else:
                owners.add(rid)
                sizes[rid] = want
                assert len(bm.block_ids(rid)) == bm.blocks_for(want)
        check(bm, owners)
