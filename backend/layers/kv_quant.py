"""A KV cache in one byte per value (`--kv-cache-dtype int8|fp8`), torch only.

Each (token, KV head) row of K or V is stored as head_dim int8 (or fp8 e4m3) values
followed by the 4 bytes of its float32 scale, in the same cache tensor: the cache is
[layers, 2, blocks, block_size, kv_heads, head_dim + 4] of the one-byte dtype, so every
block-level piece (allocation, the per-layer view, prefix caching, preemption, CUDA graph
capture, the draft model's mirrored pool) is the same as for a bf16 cache. One scale per
token and head needs no calibration and adapts to outliers as they come; it costs
4 / head_dim of the values (3% at head_dim 128). Bytes per token:
2 x layers x kv_heads x (head_dim + 4), against 2 x layers x kv_heads x head_dim x 2 in
bf16: 2 x head_dim / (head_dim + 4) times the blocks for the same budget (1.94x at 128).

Values are symmetric: x ~ q * s with s = max |x| / 127 (int8, q rounded) or / 448 (fp8,
q rounded to e4m3). Quantized when written (the store path), dequantized when read by
the torch backend here and inside the Triton kernels (backend/kernels)."""

from __future__ import annotations

import torch

from backend.config import KV_CACHE_DTYPES
from backend.layers.quant import FP8, FP8_MAX, INT8_MAX, QuantizationError, require_fp8
from backend.models.config import ModelConfig

SCALE_BYTES = 4  # one float32 per (token, KV head) of K and of V
STORAGE = {"int8": torch.int8, "fp8": FP8}
LIMITS = {torch.int8: float(INT8_MAX), FP8: float(FP8_MAX)}


def cache_dtype(kv_cache_dtype: str, compute: torch.dtype) -> torch.dtype:
    """The cache tensor's dtype: the compute dtype under "auto", else the one-byte one."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise QuantizationError(
            f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}"
        )
    return STORAGE.get(kv_cache_dtype, compute)


def check_kv_cache_dtype(kv_cache_dtype: str, device: torch.device) -> None:
    """fp8 on a GPU needs fp8 loads (compute capability 8.9+: Ada, Hopper); the CPU's torch
    path converts e4m3 itself, so it runs anywhere."""
    if kv_cache_dtype != "fp8" or device.type != "cuda":
        return
    require_fp8(device, "kv_cache_dtype fp8")


def is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype in LIMITS


def head_size(head_dim: int, dtype: torch.dtype) -> int:
    """The cache's last dimension: head_dim, plus the scale's bytes when quantized."""
    return head_dim + SCALE_BYTES if dtype in LIMITS else head_dim


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """2 (K and V) x layers x kv_heads x (head_dim values + scale bytes) x element size."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * cfg.num_kv_heads * head_size(cfg.head_dim, dtype) * elem


def allocate(
    cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """[layers, 2 (K, V), num_blocks, block_size, kv_heads, head_size] of zeros."""
    shape = (cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads)
    return torch.zeros(*shape, head_size(cfg.head_dim, dtype), dtype=dtype, device=device)


def split(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A quantized cache's (values [..., head_dim], scales [...] float32) views."""
    values = cache[..., :-SCALE_BYTES]
    scales = cache[..., -SCALE_BYTES:].view(torch.float32).squeeze(-1)
    return values, scales


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (values in `dtype`, float32 scales [...]); a row of zeros
    keeps a scale of 1 (its values are 0)."""
    x = x.float()
    limit = LIMITS[dtype]
    peak = x.abs().amax(dim=-1)
    scales = torch.where(peak > 0, peak / limit, torch.ones_like(peak))
    scaled = (x / scales[..., None]).clamp_(-limit, limit)
    values = scaled.round_().to(dtype) if dtype == torch.int8 else scaled.to(dtype)
    return values, scales


def dequantize(cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A quantized cache (or a gather of its blocks) as [..., head_dim] in `dtype`."""
    values, scales = split(cache)
    return (values.float() * scales[..., None]).to(dtype)


def write(x: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Quantize x [T, kv_heads, head_dim] into one side (K or V) of a quantized cache,
    [num_blocks, block_size, kv_heads, head_dim + 4], at `slots`."""
    values, scales = split(cache)
    q, s = quantize(x, cache.dtype)
    # As bytes: torch's CPU index ops have no fp8 kernels; the bits are what is stored.
    values.flatten(0, 1).view(torch.uint8).index_copy_(0, slots, q.view(torch.uint8))
    scales.flatten(0, 1).index_copy_(0, slots, s)


def read(cache: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The blocks of one side of a quantized cache, dequantized: [n, block_size, kv_heads,
    head_dim] in `dtype` (gathered as bytes first, so only the blocks read convert)."""
    gathered = cache.view(torch.uint8).index_select(0, blocks).view(cache.dtype)
    return dequantize(gathered, dtype)
