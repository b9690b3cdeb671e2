"""How long one engine step takes on a GPU, from the seeds' formulas (a roofline):

    FLOPs per token    = 2 x params + 4 x layers x context x hidden   (weights + attention)
    KV bytes per token = 2 x layers x kv_heads x head_dim x bytes per element
    step time          = overhead + max(FLOPs / (peak FLOP/s x mfu),
                                        bytes read / (HBM bandwidth x mbu))

where a step reads the weights once plus the KV cache of every scheduled request's
context. Prefill-heavy steps land on the compute roof, decode-heavy ones on the bandwidth
roof."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_params: float
    num_layers: int
    hidden_size: int
    num_kv_heads: int
    head_dim: int
    bytes_per_param: int = 2  # bf16 weights and KV

    @property
    def weight_bytes(self) -> float:
        return self.num_params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.bytes_per_param


@dataclass(frozen=True)
class GpuSpec:
    name: str
    peak_flops: float  # dense bf16 FLOP/s
    hbm_bandwidth: float  # bytes/s
    memory_bytes: float


LLAMA3_8B = ModelSpec(
    "llama-3-8b", 8.03e9, num_layers=32, hidden_size=4096, num_kv_heads=8, head_dim=128
)
H100 = GpuSpec("h100-sxm", peak_flops=989e12, hbm_bandwidth=3.35e12, memory_bytes=80e9)
H200 = GpuSpec("h200-sxm", peak_flops=989e12, hbm_bandwidth=4.8e12, memory_bytes=141e9)


@dataclass(frozen=True)
class CostModel:
    model: ModelSpec = LLAMA3_8B
    gpu: GpuSpec = H100
    mfu: float = 0.5  # share of peak FLOP/s a real prefill reaches
    mbu: float = 0.8  # share of peak bandwidth a real decode reaches
    step_overhead_s: float = 0.002  # scheduling, launch and sampling per step

    def step_time(self, chunks: Iterable[tuple[int, int]]) -> float:
        """Seconds for one step computing `num_tokens` new tokens at `start` for each
        (start, num_tokens) chunk."""
        m = self.model
        flops = 0.0
        kv_bytes = 0.0
        for start, n in chunks:
            # Token i of the chunk attends to start + i + 1 positions.
            context = n * start + n * (n + 1) / 2
            flops += 2 * m.num_params * n + 4 * m.num_layers * m.hidden_size * context
            kv_bytes += (start + n) * m.kv_bytes_per_token
        compute = flops / (self.gpu.peak_flops * self.mfu)
        memory = (m.weight_bytes + kv_bytes) / (self.gpu.hbm_bandwidth * self.mbu)
        return self.step_overhead_s + max(compute, memory)

    def kv_blocks(self, block_size: int, utilization: float = 0.9) -> int:
        """How many KV blocks fit in the GPU's memory next to the weights."""
        free = self.gpu.memory_bytes * utilization - self.model.weight_bytes
        return max(1, int(free // (self.model.kv_bytes_per_token * block_size)))
