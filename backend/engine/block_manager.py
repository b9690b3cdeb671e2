"""A pool of fixed-size KV blocks, one block table per request, and the prefix cache.
Pure Python: it hands out block ids; the model runner owns the tensors they index.

Every block is in exactly one state: used (ref_count > 0), cached (ref_count == 0 but
holding a registered prefix, so a later request may take it back) or free (ref_count == 0,
no content). Cached and free blocks sit in one queue in eviction order: free blocks at the
head (reused first), cached blocks appended at the tail when released, so the least
recently used cached block is evicted first.

Prefix caching: each full block's hash chains its parent's hash, its token ids and the
request's cache salt, so a hash names the whole prefix up to that block. A hit is taken
only if the cached block's token ids are the ones asked for."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from backend.engine.request import Request

BlockHash = bytes
_ROOT = bytes(16)  # the "parent" of a request's first block


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], salt: str | None) -> BlockHash:
    """128-bit BLAKE2b of parent hash + token ids + salt: a collision across prefixes (or
    tenants) cannot be crafted, unlike with Python's hash()."""
    h = hashlib.blake2b(parent or _ROOT, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    if salt is not None:
        h.update(salt.encode())
    return h.digest()


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None  # set once the block is full and registered
    token_ids: tuple[int, ...] = ()  # what the hash covers, for the equality check


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free and cached blocks in eviction order (an ordered set: O(1) removal of a hit).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[BlockHash, int] = {}
        self._num_cached_free = 0
        self._tables: dict[str, list[int]] = {}
        self._num_registered: dict[str, int] = {}  # leading table blocks already in the cache

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: free ones, then cached ones (evicting them)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Unreferenced blocks that still hold a cached prefix."""
        return self._num_cached_free

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks) - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def num_cached_tokens(self, request_id: str) -> int:
        """Tokens of the request's leading blocks registered in the prefix cache: what a
        recompute after freeing its blocks finds there, unless they are evicted first."""
        return self._num_registered.get(request_id, 0) * self.block_size

    def get_computed_blocks(self, req: Request) -> list[int]:
        """The longest run of cached blocks equal to the request's leading full blocks,
        leaving at least one token to compute (its logits are needed). Takes nothing."""
        if not self.enable_caching:
            return []
        limit = (req.num_tokens - 1) // self.block_size
        self._extend_hashes(req, limit)
        hits: list[int] = []
        bs = self.block_size
        for i in range(limit):
            block_id = self._cached.get(req.block_hashes[i])
            if block_id is None:
                break
            if self.blocks[block_id].token_ids != tuple(req.token_ids(i * bs, (i + 1) * bs)):
                break
            hits.append(block_id)
        return hits

    def allocate_slots(
        self, request_id: str, num_tokens: int, computed: Sequence[int] = ()
    ) -> list[int] | None:
        """Grow the request's table to hold `num_tokens` tokens in total, starting with the
        already-computed blocks `computed` (prefix-cache hits or a sibling's prompt blocks,
        on the first allocation only). Returns the newly added block ids, or None, having
        changed nothing, when the pool is short: the caller must wait or preempt."""
        table = self._tables.get(request_id)
        have = len(computed) + (len(table) if table else 0)
        need = max(self.blocks_for(num_tokens) - have, 0)
        revived = sum(1 for b in computed if self.blocks[b].ref_count == 0)
        if need + revived > len(self._free):
            return None
        if table is None:
            table = self._tables[request_id] = []
            self._num_registered[request_id] = len(computed)
        for block_id in computed:  # before popping new blocks: a hit must not be evicted
            self._take(block_id)
        table += computed
        new = [self._pop_free() for _ in range(need)]
        table += new
        return new

    def cache_blocks(self, req: Request) -> None:
        """Register the request's newly full, computed blocks in the prefix cache."""
        if not self.enable_caching:
            return
        table = self._tables.get(req.request_id)
        if table is None:
            return
        full = min(req.num_computed_tokens // self.block_size, len(table))
        start = self._num_registered[req.request_id]
        if full <= start:
            return
        self._extend_hashes(req, full)
        bs = self.block_size
        for i in range(start, full):
            block = self.blocks[table[i]]
            block_hash = req.block_hashes[i]
            # Already registered (a hit), or the same prefix computed twice at once: keep
            # the first copy findable; this one simply stays uncached.
            if block.block_hash is None and block_hash not in self._cached:
                block.block_hash = block_hash
                block.token_ids = tuple(req.token_ids(i * bs, (i + 1) * bs))
                self._cached[block_hash] = block.block_id
        self._num_registered[req.request_id] = full

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Give back the table's blocks past those `num_tokens` tokens need: slots held for
        draft tokens that were rejected. They were never registered (only computed full
        blocks are), so they go back as free blocks, reused first."""
        table = self._tables.get(request_id)
        if table is None:
            return
        keep = max(self.blocks_for(num_tokens), self._num_registered[request_id])
        while len(table) > keep:
            block = self.blocks[table.pop()]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = None
                self._free.move_to_end(block.block_id, last=False)

    def free(self, request_id: str) -> None:
        """Release the request's blocks; a second call is a no-op. Tail blocks are released
        first so that, among cached blocks, a prefix's end is evicted before its start."""
        self._num_registered.pop(request_id, None)
        for block_id in reversed(self._tables.pop(request_id, [])):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block_id, last=False)  # empty: reuse first
                else:
                    self._num_cached_free += 1

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use keep their contents)."""
        for block in self.blocks:
            if block.block_hash is not None and block.ref_count == 0:
                self._free.move_to_end(block.block_id, last=False)
            block.block_hash, block.token_ids = None, ()
        self._cached.clear()
        self._num_cached_free = 0
        for request_id, table in self._tables.items():
            self._num_registered[request_id] = len(table)  # never re-register old blocks

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
            self._num_cached_free -= 1
        block.ref_count += 1

    def _pop_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict the least recently used cached prefix
            del self._cached[block.block_hash]
            block.block_hash, block.token_ids = None, ()
            self._num_cached_free -= 1
        block.ref_count = 1
        return block_id

    def _extend_hashes(self, req: Request, num_blocks: int) -> None:
        hashes, bs = req.block_hashes, self.block_size
        for i in range(len(hashes), num_blocks):
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, req.token_ids(i * bs, (i + 1) * bs), req.cache_salt))
