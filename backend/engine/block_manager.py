"""A pool of fixed-size KV blocks and one block table per request. Pure Python: it hands
out block ids; the model runner owns the tensors they index."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    # Prefix caching will set this to the chained hash of a full block's tokens and keep
    # freed hashed blocks findable until they are reused.
    block_hash: int | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))  # allocate from the left
        self._tables: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks) - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def allocate_slots(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Grow the request's table to hold `num_tokens` tokens in total. Returns the newly
        added block ids, or None (allocating nothing) when the pool is short."""
        table = self._tables.get(request_id, [])
        need = self.blocks_for(num_tokens) - len(table)
        if need > len(self._free):
            return None
        new = [self._free.popleft() for _ in range(max(need, 0))]
        for block_id in new:
            self.blocks[block_id].ref_count = 1
        self._tables[request_id] = table + new
        return new

    def free(self, request_id: str) -> None:
        """Return the request's blocks to the pool; a second call is a no-op."""
        for block_id in reversed(self._tables.pop(request_id, [])):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free.append(block_id)
