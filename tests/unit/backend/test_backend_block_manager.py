"""The block pool: allocation, None when short, prefix-cache registration, hits and LRU
eviction, with the books checked after each operation."""

from __future__ import annotations

from backend.engine.block_manager import BlockManager, hash_block
from backend.engine.request import Request, fan_out
from backend.requests import EngineRequest
from backend.sampling import SamplingParams
from tests.unit.backend.accounting import check_accounting


def computed(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    """A request whose every token has been computed (as after a prefill step)."""
    asked = EngineRequest(tokens, SamplingParams(), rid)
    (req,) = fan_out(asked, tokens, len(tokens) + 1, cache_salt=salt)
    req.num_computed_tokens = len(tokens)
    return req


def run(bm: BlockManager, req: Request) -> list[int]:
    """Admit with prefix-cache hits, allocate, compute, register; returns the hits."""
    hits = bm.get_computed_blocks(req)
    assert bm.allocate_slots(req.request_id, req.num_tokens, hits) is not None
    bm.cache_blocks(req)
    return hits


def test_allocation_grows_the_table_and_none_means_no_room() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    assert bm.allocate_slots("a", 5) == [0, 1]
    assert bm.allocate_slots("a", 8) == []
    assert bm.allocate_slots("a", 9) == [2]
    assert bm.allocate_slots("b", 8) is None
    assert bm.block_ids("b") == [] and bm.num_free_blocks == 1
    check_accounting(bm, ["a"])
    bm.free("a")
    bm.free("a")
    bm.free("unknown")
    assert bm.num_free_blocks == 4
    assert bm.allocate_slots("b", 16) is not None
    check_accounting(bm, ["b"])


def test_the_hash_chains_parent_tokens_and_salt() -> None:
    root = hash_block(None, [1, 2, 3, 4], None)
    assert root == hash_block(None, [1, 2, 3, 4], None)
    assert root != hash_block(None, [1, 2, 3, 5], None)
    assert root != hash_block(None, [1, 2, 3, 4], "tenant-a")
    assert hash_block(None, [1, 2, 3, 4], "a") != hash_block(None, [1, 2, 3, 4], "b")
    child = hash_block(root, [5, 6, 7, 8], None)
    assert child != hash_block(hash_block(None, [0, 2, 3, 4], None), [5, 6, 7, 8], None)


def test_released_blocks_stay_cached_until_evicted_lru() -> None:
    bm = BlockManager(num_blocks=6, block_size=4)
    run(bm, computed("a", list(range(9))))  # 2 full blocks registered, 1 partial
    bm.free("a")
    check_accounting(bm, [])
    assert (bm.num_cached_blocks, bm.num_free_blocks, bm.num_used_blocks) == (2, 6, 0)
    # A later request with the same prefix takes the cached blocks back.
    hits = run(bm, computed("b", [*range(8), 99]))
    assert len(hits) == 2 and bm.num_cached_blocks == 0
    check_accounting(bm, ["b"])
    bm.free("b")
    run(bm, computed("c", list(range(100, 117))))  # 5 blocks: the 4 empty ones go first
    assert bm.num_cached_blocks == 1  # then the LRU cached block: the prefix's tail
    assert len(bm.get_computed_blocks(computed("d", list(range(9))))) == 1
    check_accounting(bm, ["c"])


def test_a_cache_hit_is_taken_before_new_blocks_are_popped() -> None:
    # The only free blocks are cached ones; the hit must not be evicted to make room.
    bm = BlockManager(num_blocks=3, block_size=4)
    run(bm, computed("a", list(range(9))))
    bm.free("a")
    req = computed("b", [*range(4), 50, 51, 52, 53, 54])
    hits = bm.get_computed_blocks(req)
    assert len(hits) == 1
    assert bm.allocate_slots("b", 9, hits) is not None
    assert bm.block_ids("b")[0] == hits[0]
    check_accounting(bm, ["b"])


def test_the_same_prefix_computed_twice_is_cached_once() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    for rid in "ab":  # both allocated before either registers: no hits, two copies
        assert bm.allocate_slots(rid, 5) is not None
    for rid in "ab":
        bm.cache_blocks(computed(rid, list(range(5))))
    check_accounting(bm, ["a", "b"])
    assert sum(b.block_hash is not None for b in bm.blocks) == 1
    bm.free("a")
    bm.free("b")
    assert bm.num_cached_blocks == 1
    check_accounting(bm, [])


def test_reset_prefix_cache() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    run(bm, computed("a", list(range(9))))
    bm.free("a")
    bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0 and bm.get_computed_blocks(computed("b", list(range(9)))) == []
    check_accounting(bm, [])
