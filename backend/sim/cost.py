"""The one cost model of a step on an accelerator, from the seeds' formulas (a roofline),
shared by the simulator (backend/sim) and the capacity planner (backend/capacity):

    weights bytes      = params x bytes per weight
    FLOPs per token    = 2 x params + 4 x layers x context x hidden   (weights + attention)
    KV bytes per token = 2 x layers x kv_heads x head_dim x bytes per KV element
    step time          = overhead + requests x per-request overhead
                         + max(FLOPs / (peak FLOP/s x mfu), bytes read / (HBM bandwidth x mbu))

where a step reads the weights once plus the KV cache of every scheduled request's
context. Prefill-heavy steps land on the compute roof, decode-heavy ones on the bandwidth
roof. With mfu = mbu = 1 and no overhead the step time is the roofline floor."""

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
    bytes_per_param: float = 2  # weights: bf16 2, fp8/int8 1, int4 0.5
    kv_bytes_per_element: float = 2  # the KV cache's own dtype
    kv_scale_bytes: float = 0  # per token and KV head of K and of V (a one-byte cache's)

    @property
    def weight_bytes(self) -> float:
        return self.num_params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        per_head = self.head_dim * self.kv_bytes_per_element + self.kv_scale_bytes
        return 2 * self.num_layers * self.num_kv_heads * per_head

    def flops_per_token(self, context: float) -> float:
        """One new token attending to `context` positions."""
        return 2 * self.num_params + 4 * self.num_layers * context * self.hidden_size


@dataclass(frozen=True)
class GpuSpec:
    name: str
    peak_flops: float  # dense FLOP/s at the weights' precision
    hbm_bandwidth: float  # bytes/s
    memory_bytes: float


LLAMA3_8B = ModelSpec(
    "llama-3-8b", 8.03e9, num_layers=32, hidden_size=4096, num_kv_heads=8, head_dim=128
)
H100 = GpuSpec("h100-sxm", peak_flops=989e12, hbm_bandwidth=3.35e12, memory_bytes=80e9)
H200 = GpuSpec("h200-sxm", peak_flops=989e12, hbm_bandwidth=4.8e12, memory_bytes=141e9)


@dataclass(frozen=True)
class Roofs:
    """A step's two roofs, in seconds at the model's efficiencies (overhead excluded)."""

    compute_s: float
    memory_s: float

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"


@dataclass(frozen=True)
class CostModel:
    model: ModelSpec = LLAMA3_8B
    gpu: GpuSpec = H100
    mfu: float = 0.5  # share of peak FLOP/s a real prefill reaches
    mbu: float = 0.8  # share of peak bandwidth a real decode reaches
    step_overhead_s: float = 0.002  # scheduling, launch and sampling per step
    seq_overhead_s: float = 0.0  # per scheduled request per step (sampling, detokenising)

    def roofs(self, chunks: Iterable[tuple[int, int]]) -> Roofs:
        """The roofs of one step computing `num_tokens` new tokens at `start` for each
        (start, num_tokens) chunk."""
        m = self.model
        flops = 0.0
        kv_tokens = 0
        for start, n in chunks:
            # Token i of the chunk attends to start + i + 1 positions.
            context = n * start + n * (n + 1) / 2
            flops += 2 * m.num_params * n + 4 * m.num_layers * m.hidden_size * context
            kv_tokens += start + n
        bytes_read = m.weight_bytes + kv_tokens * m.kv_bytes_per_token
        return Roofs(
            flops / (self.gpu.peak_flops * self.mfu),
            bytes_read / (self.gpu.hbm_bandwidth * self.mbu),
        )

    def overhead(self, num_requests: int) -> float:
        return self.step_overhead_s + self.seq_overhead_s * num_requests

    def step_time(self, chunks: Iterable[tuple[int, int]]) -> float:
        scheduled = list(chunks)
        roofs = self.roofs(scheduled)
        return self.overhead(len(scheduled)) + max(roofs.compute_s, roofs.memory_s)

    def decode_chunks(self, batch: int, context: int) -> list[tuple[int, int]]:
        """`batch` sequences each decoding one token with `context` tokens of KV."""
        return [(max(context - 1, 0), 1)] * batch

    def decode_step(self, batch: int, context: int) -> float:
        return self.step_time(self.decode_chunks(batch, context))

    def prefill_step(self, prompt_tokens: int) -> float:
        """One step prefilling a whole prompt (and sampling its first token)."""
        return self.step_time([(0, prompt_tokens)])

    def compute_bound_batch(self, context: int) -> float | None:
        """The decode batch at `context` from which the compute roof is the higher one:
        B x FLOPs/token / (peak x mfu) >= (weights + B x context x KV/token) / (bw x mbu).
        None when KV reads grow as fast as the compute (it never turns compute-bound)."""
        m = self.model
        compute_per_seq = m.flops_per_token(context) / (self.gpu.peak_flops * self.mfu)
        bandwidth = self.gpu.hbm_bandwidth * self.mbu
        kv_per_seq = context * m.kv_bytes_per_token / bandwidth
        if compute_per_seq <= kv_per_seq:
            return None
        return (m.weight_bytes / bandwidth) / (compute_per_seq - kv_per_seq)

    def kv_blocks(self, block_size: int, utilization: float = 0.9) -> int:
        """How many KV blocks fit in the GPU's memory next to the weights."""
        free = self.gpu.memory_bytes * utilization - self.model.weight_bytes
        return max(1, int(free // (self.model.kv_bytes_per_token * block_size)))
