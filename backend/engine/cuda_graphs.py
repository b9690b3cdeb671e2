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

from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

import numpy as np
import torch

from backend.attention_metadata import AttentionMetadata
from backend.engine.batch import ScheduledRequest
from backend.engine.block_tables import DeviceBlockTables
from backend.layers.staging import to_device

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
        # [n + 1], then each row's row in the device block tables [n]. Two host buffers,
        # used in turn: a step is filled while the previous one's copy may be in flight.
        self._lengths = (n, n, n, n, n + 1, n)
        total = sum(self._lengths)
        pin = device.type == "cuda"
        self._hosts = [torch.zeros(total, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._host = self._hosts[0]
        self._static = torch.zeros(total, dtype=torch.int64, device=device)
        # The batch's block tables, gathered on the device from DeviceBlockTables' rows.
        self._tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.replays = 0

    def _split(self, flat: Buffer) -> list[Buffer]:
        parts, offset = [], 0
        for length in self._lengths:
            parts.append(flat[offset : offset + length])
            offset += length
        return parts

    def _run(self, size: int) -> torch.Tensor:
        # Fresh views on every call: nothing memoised on a tensor's identity (the rotary
        # table's rows) carries over from the warm-up into a capture.
        ids, positions, slots, seq_lens, starts, _ = self._split(self._static)
        meta = self.backend.decode_metadata(
            slots[:size], self._tables[:size], seq_lens[:size], starts[: size + 1], self.block_size
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

    def takes(self, reqs: Sequence[ScheduledRequest]) -> bool:
        """A decode-only batch (one token a row, no LoRA adapter) of a captured size."""
        return self.fits(len(reqs)) and all(len(r.token_ids) == 1 and r.lora_slot < 0 for r in reqs)

    def replay_rows(
        self,
        reqs: list[ScheduledRequest],
        tables: DeviceBlockTables,
        patch: Callable[[torch.Tensor], object] | None = None,
    ) -> torch.Tensor:
        """`replay` of a batch that `takes`, its rows' block-table changes written first."""
        rows, changes = tables.plan(reqs)
        if changes:
            tables.apply(to_device(torch.tensor(changes, dtype=torch.int64), self.device))
        return self.replay(
            [r.token_ids[0] for r in reqs],
            [r.start_pos for r in reqs],
            [r.block_ids for r in reqs],
            tables,
            rows,
            patch,
        )

    def replay(
        self,
        input_ids: list[int],
        positions: list[int],
        block_ids: list[list[int]],
        tables: DeviceBlockTables,
        rows: list[int],
        patch: Callable[[torch.Tensor], object] | None = None,
    ) -> torch.Tensor:
        """Hidden states [B, hidden] of a decode-only batch (token i at positions[i] of a
        sequence whose blocks are block_ids[i], held in row rows[i] of `tables`); valid
        until the next replay. `patch` may rewrite the input ids on the device first
        (async scheduling's tokens still on the device)."""
        num = len(input_ids)
        size = next(s for s in self.sizes if s >= num)
        self._host = self._hosts[self.replays % 2]
        self._fill(input_ids, positions, block_ids, size, rows)
        self._static.copy_(self._host, non_blocking=True)
        ids, *_, static_rows = self._split(self._static)
        torch.index_select(tables.table, 0, static_rows[:num], out=self._tables[:num])
        if patch is not None:
            patch(ids[:num])
        self.replays += 1
        if self.device.type != "cuda":
            return self._run(size)[:num]
        self._graphs[size].replay()
        return self._outputs[size][:num]

    def _fill(
        self,
        input_ids: list[int],
        positions: list[int],
        block_ids: list[list[int]],
        size: int,
        rows: list[int] | None = None,
    ) -> None:
        """The host buffer of a batch padded to `size`. Padding: token 0 at position 0,
        slot -1, one token of context (the padded rows' tables hold whatever an earlier
        replay left: valid block ids, and only the first is read). This buffer's previous
        copy is done: a step reads its tokens back before the step after next is filled."""
        num, bs = len(input_ids), self.block_size
        ids, pos, slots, lens, starts, table_rows = self._split(self._host.numpy())
        ids[:num], ids[num:size] = input_ids, 0
        pos[:num], pos[num:size] = positions, 0
        slots[:num] = [b[p // bs] * bs + p % bs for p, b in zip(positions, block_ids, strict=True)]
        slots[num:size] = -1
        lens[:num], lens[num:size] = [p + 1 for p in positions], 1
        starts[: size + 1] = np.arange(size + 1)
        table_rows[:num] = rows if rows is not None else 0
