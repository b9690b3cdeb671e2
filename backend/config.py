"""Engine configuration: plain data, validated on construction, no torch import."""

from __future__ import annotations

import re
from dataclasses import dataclass

DTYPES = ("auto", "float32", "float16", "bfloat16")
_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


@dataclass(frozen=True)
class EngineConfig:
    """How big the engine may get. The KV pool is `num_kv_blocks` if given, else as many
    blocks as fit in `kv_cache_bytes`. `max_model_len=None` takes the model's context,
    capped by `max_num_batched_tokens` (a prompt is prefilled in one step until chunked
    prefill lands)."""

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_bytes: int = 256 * 2**20
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    dtype: str = "auto"  # "auto": float32 on CPU, the checkpoint's dtype on CUDA
    device: str = "cpu"
    # CPU threads for torch ops (process-wide). None keeps torch's default; on a small
    # machine one thread fewer than the cores leaves the event loop room to stream.
    cpu_threads: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_size", "kv_cache_bytes", "max_num_seqs", "max_num_batched_tokens"):
            _positive(name, getattr(self, name))
        for name in ("num_kv_blocks", "max_model_len", "cpu_threads"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not _DEVICE.match(self.device):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.max_model_len is not None and self.max_model_len > self.max_num_batched_tokens:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) must not exceed max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) until chunked prefill exists"
            )


def _positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
