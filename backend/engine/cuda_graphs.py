"""CUDA graphs of the decode step: one token per sequence, captured once per batch size
in 1, 2, 4, 8, then every 16 up to max_num_seqs, replayed with the real batch padded to
the next captured size. A replay launches the whole forward pass at once, which at small
batches is most of a decode step's time.

The graphs read static device buffers that each replay fills with one copy from one
pinned host buffer. Padded rows have slot -1 (their K/V are not stored), context length
1 and block table row 0, so they compute harmless garbage that nobody reads.

Only an attention backend that builds its metadata from tensors alone can be captured:
it says so by having `decode_metadata` (the torch reference loops over Python lengths,
so it cannot). On the CPU, for tests, "replay" runs the same forward on the same static
buffers eagerly."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

import numpy as np
import torch

from backend.attention_metadata import AttentionMetadata

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]
Buffer = TypeVar("Buffer", torch.Tensor, np.ndarray)


class GraphableBackend(Protocol):
    def decode_metadata(
        self,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        block_size: int,
    ) -> AttentionMetadata:
        """Metadata of a decode-only batch whose kernels read only these device tensors
        (their values may change between replays; their shapes do not)."""


def can_capture(backend: object) -> bool:
    return callable(getattr(backend, "decode_metadata", None))


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 32, 48, ... up to max_num_seqs (which is always one of them)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += range(16, max_num_seqs, 16)
    return [*sizes, max_num_seqs]


class DecodeGraphs:
    def __init__(
        self,
        forward: Forward,
        backend: GraphableBackend,
        max_num_seqs: int,
        max_blocks: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.forward, self.backend, self.block_size = forward, backend, block_size
        self.device = device
        self.sizes = capture_sizes(max_num_seqs)
        self.max_blocks = max_blocks
        n = max_num_seqs
        # One flat int64 buffer: ids, positions, slots, seq_lens [n] each, query_start_loc
        # [n + 1], then the block tables [n, max_blocks] (last, so a replay copies only the
        # rows it uses).
        self._lengths = (n, n, n, n, n + 1, n * max_blocks)
        self._tables_at = sum(self._lengths[:5])
        total = sum(self._lengths)
        self._host = torch.zeros(total, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._static = torch.zeros(total, dtype=torch.int64, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.replays = 0

    def _split(self, flat: Buffer) -> list[Buffer]:
        parts, offset = [], 0
        for length in self._lengths:
            parts.append(flat[offset : offset + length])
            offset += length
        parts[5] = parts[5].reshape(-1, self.max_blocks)
        return parts

    def _run(self, size: int) -> torch.Tensor:
        # Fresh views on every call: nothing memoised on a tensor's identity (the rotary
        # table's rows) carries over from the warm-up into a capture.
        ids, positions, slots, seq_lens, starts, tables = self._split(self._static)
        meta = self.backend.decode_metadata(
            slots[:size], tables[:size], seq_lens[:size], starts[: size + 1], self.block_size
        )
        return self.forward(ids[:size], positions[:size], meta)

    def capture(self) -> None:
        """Largest first, all in one memory pool (the outputs alias: one replays at a time)."""
        self._fill([], [], [], self.sizes[-1])
        self._static.copy_(self._host)
        if self.device.type != "cuda":
            return
        pool = None
        for size in reversed(self.sizes):
            self._run(size)  # warm-up: lazy set-up and autotuning stay out of the graph
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[size] = self._run(size)
            pool = graph.pool()
            self._graphs[size] = graph
        torch.cuda.synchronize(self.device)

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.sizes[-1]

    def replay(
        self, input_ids: list[int], positions: list[int], block_ids: list[list[int]]
    ) -> torch.Tensor:
        """Hidden states [B, hidden] of a decode-only batch (token i at positions[i] of a
        sequence whose blocks are block_ids[i]); valid until the next replay."""
        num = len(input_ids)
        size = next(s for s in self.sizes if s >= num)
        self._fill(input_ids, positions, block_ids, size)
        used = self._tables_at + size * self.max_blocks
        self._static[:used].copy_(self._host[:used], non_blocking=True)
        self.replays += 1
        if self.device.type != "cuda":
            return self._run(size)[:num]
        self._graphs[size].replay()
        return self._outputs[size][:num]

    def _fill(
        self, input_ids: list[int], positions: list[int], block_ids: list[list[int]], size: int
    ) -> None:
        """The host buffer of a batch padded to `size`. Padding: token 0 at position 0,
        slot -1, one token of context in block 0. Table columns past a row's context are
        never read, so stale values there are left alone. The previous replay's copy is
        done: every step ends by reading its tokens back."""
        num, bs = len(input_ids), self.block_size
        ids, pos, slots, lens, starts, tables = self._split(self._host.numpy())
        ids[:num], ids[num:size] = input_ids, 0
        pos[:num], pos[num:size] = positions, 0
        slots[:num] = [b[p // bs] * bs + p % bs for p, b in zip(positions, block_ids, strict=True)]
        slots[num:size] = -1
        lens[:num], lens[num:size] = [p + 1 for p in positions], 1
        starts[: size + 1] = np.arange(size + 1)
        for row, blocks in enumerate(block_ids):
            tables[row, : len(blocks)] = blocks
        tables[num:size, 0] = 0
