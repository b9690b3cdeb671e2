"""The block tables of live requests, kept on the device as one int32 tensor with a row
per request, written by difference: a step stages only the entries that changed since
the row was last written (a decoding row gains a block every block_size steps), and its
batch's table is a gather of its rows on the device. Rebuilding and copying every row's
whole table each step cost host time that grows with context; this costs ~nothing for
rows that did not change.

The host keeps what each row holds (the block list last written), so a change of any
kind (blocks appended, a tail trimmed after rejected drafts, a preempted request
readmitted on other blocks) is found by comparing lists, and the row is rewritten from
the first entry that differs."""

from __future__ import annotations

import torch

from backend.engine.batch import ScheduledRequest


class DeviceBlockTables:
    def __init__(self, width: int, device: torch.device, rows: int = 64) -> None:
        self.width = width  # a multiple of 16: the kernels' stride never changes
        self.device = device
        self.table = torch.zeros(rows, width, dtype=torch.int32, device=device)
        self._row_of: dict[str, int] = {}
        self._known: list[list[int]] = [[] for _ in range(rows)]
        self._free = list(range(rows - 1, -1, -1))  # popped from the end: row 0 first

    def release(self, request_ids: list[str]) -> None:
        """Rows of requests that left go back (their stale entries are never read: a
        new owner's row is rewritten from its first differing entry)."""
        for request_id in request_ids:
            row = self._row_of.pop(request_id, None)
            if row is not None:
                self._free.append(row)

    def plan(self, reqs: list[ScheduledRequest]) -> tuple[list[int], list[int]]:
        """Each request's row, and the changed entries as a flat list of (row, column,
        block) triples (what `apply` writes once they are on the device)."""
        rows: list[int] = []
        changes: list[int] = []
        for r in reqs:
            row = self._row_of.get(r.request_id)
            if row is None:
                row = self._row_of[r.request_id] = self._take_row()
            rows.append(row)
            known, blocks = self._known[row], r.block_ids
            if known == blocks:  # most rows, most steps
                continue
            first = _first_difference(known, blocks)
            for col in range(first, len(blocks)):
                changes += (row, col, blocks[col])
            self._known[row] = blocks  # the scheduler's copy for this step: never mutated
        return rows, changes

    def apply(self, changes: torch.Tensor) -> None:
        """Write the staged (row, column, block) triples ([3 * n] on the device)."""
        if changes.numel():
            triples = changes.view(-1, 3)
            self.table[triples[:, 0], triples[:, 1]] = triples[:, 2].to(torch.int32)

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """[len(rows), width] int32: the batch's tables, in batch order."""
        return self.table.index_select(0, rows)

    def _take_row(self) -> int:
        if not self._free:  # more live requests than rows (preempted ones keep theirs)
            old = self.table.shape[0]
            grown = torch.zeros(old, self.width, dtype=torch.int32, device=self.device)
            self.table = torch.cat([self.table, grown])
            self._known += [[] for _ in range(old)]
            self._free = list(range(2 * old - 1, old - 1, -1))
        return self._free.pop()


def _first_difference(known: list[int], blocks: list[int]) -> int:
    """The first index where `blocks` differs from what the row holds."""
    n = min(len(known), len(blocks))
    if known[:n] == blocks[:n]:
        return n
    return next(i for i in range(n) if known[i] != blocks[i])
