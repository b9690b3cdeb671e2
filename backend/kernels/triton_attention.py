"""`TritonPagedAttention`: the AttentionBackend of backend/layers/attention.py on the
Triton kernels beside it."""

from __future__ import annotations

import torch
import triton

from backend.attention_metadata import AttentionMetadata
from backend.kernels.kv_cache import write_kv
from backend.kernels.paged_attention import paged_attention


class TritonPagedAttention:
    """One kernel launch per layer for the whole flat batch. Decode-only steps over long
    contexts with few (sequence, KV head) programs take the split path: each program's
    keys in `num_segments` parts, merged by log-sum-exp, so a handful of long sequences
    still spreads over the GPU. A captured decode step (CUDA graphs) cannot see its
    contexts, so each batch size is captured with a fixed split sized to fill the SMs."""

    def __init__(
        self,
        split_min_seq_len: int = 1024,
        num_segments: int = 16,
        max_split_programs: int = 512,
        sm_count: int | None = None,
    ) -> None:
        self.split_min_seq_len = split_min_seq_len
        self.num_segments = num_segments
        self.max_split_programs = max_split_programs
        self.sm_count = sm_count or _sm_count()

    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        write_kv(k, v, kv_cache[0], kv_cache[1], meta.slot_mapping)

    def attend(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        seq_lens, starts = meta.seq_lens_tensor, meta.query_start_tensor
        assert seq_lens is not None and starts is not None  # filled in by the metadata
        out, _ = paged_attention(
            q,
            kv_cache[0],
            kv_cache[1],
            meta.block_tables,
            seq_lens,
            starts,
            scale,
            meta.max_query_len,
            self.segments(meta, kv_cache.shape[-2]),
        )
        return out

    def decode_metadata(
        self,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        block_size: int,
    ) -> AttentionMetadata:
        """A decode-only batch's metadata that reads only these device tensors, so a CUDA
        graph can replay it with new values (backend/engine/cuda_graphs.py). The host-side
        lengths are placeholders for one token per row: the kernel takes its lengths from
        the tensors, and the unsplit path, which a captured graph freezes, holds for any
        context."""
        rows = block_tables.shape[0]
        return AttentionMetadata(
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            seq_lens=[1] * rows,
            query_start_loc=list(range(rows + 1)),
            block_size=block_size,
            seq_lens_tensor=seq_lens,
            query_start_tensor=query_start_loc,
            captured=True,
        )

    def segments(self, meta: AttentionMetadata, kv_heads: int) -> int:
        """How many parts each program's keys are split into: 1 unless flash-decoding
        pays (decode-only, a long context, a small grid). A captured step is split by its
        grid alone (`captured_segments`): a replay serves any context."""
        if meta.captured:
            return self.captured_segments(len(meta.seq_lens), kv_heads)
        split = (
            meta.max_query_len == 1
            and meta.max_seq_len >= self.split_min_seq_len
            and len(meta.seq_lens) * kv_heads <= self.max_split_programs
        )
        return self.num_segments if split else 1

    def captured_segments(self, rows: int, kv_heads: int) -> int:
        """Segments for a captured decode step of `rows` sequences: enough programs to
        fill the SMs (at most num_segments, a power of two); 1 once the rows alone do.
        The kernel skips a segment past a short context's last key, so a short context
        pays only its share of empty programs and the merge."""
        programs = rows * kv_heads
        if programs >= self.sm_count:
            return 1
        wanted = triton.next_power_of_2(-(-self.sm_count // programs))
        return int(min(self.num_segments, wanted))


def _sm_count() -> int:
    """The device's streaming multiprocessors; an H100 SXM's 132 where there is no GPU
    (the interpreter's tests model that device)."""
    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(0).multi_processor_count)
    return 132
