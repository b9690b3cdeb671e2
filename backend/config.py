"""Engine configuration: plain data, validated on construction, no torch import."""

from __future__ import annotations

import re
from dataclasses import dataclass

DTYPES = ("auto", "float32", "float16", "bfloat16")
_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


@dataclass(frozen=True)
class EngineConfig:
    """How big the engine may get. The KV pool is `num_kv_blocks` if given, else as many
    blocks as fit in `kv_cache_bytes` on the CPU, or in `gpu_memory_utilization` of the
    GPU's memory less what is in use once the weights are loaded. `max_model_len=None`
    takes the model's context, capped by what the KV pool holds. Prompts longer than
    `max_num_batched_tokens` are prefilled in chunks over several steps.

    Prefix caching reuses the KV of identical prompt prefixes; the tenant id salts every
    block hash, so tenants never share cached prompts unless `share_prefix_cache`."""

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
    enable_prefix_caching: bool = True
    share_prefix_cache: bool = False  # True: all tenants share one prefix cache
    gpu_memory_utilization: float = 0.9

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
        util = self.gpu_memory_utilization
        if isinstance(util, bool) or not isinstance(util, int | float) or not 0 < util <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {util!r}")
        for name in ("enable_prefix_caching", "share_prefix_cache"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")


def _positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
