"""A model's shape and a GPU's figures, as the planner needs them: parameters counted
exactly from the shapes, the KV bytes per token, and the peak FLOP/s at a precision."""

from __future__ import annotations

from dataclasses import dataclass

from backend.capacity.errors import CapacityInputError
from backend.models.config import ModelConfig

# Bytes per element of each precision; int4 is weight-only (two weights per byte).
DTYPE_BYTES: dict[str, float] = {
    "fp32": 4,
    "bf16": 2,
    "fp16": 2,
    "fp8": 1,
    "int8": 1,
    "int4": 0.5,
}
# A one-byte KV cache's float32 scale per token and KV head, of K and of V, stored beside
# the values (the engine's --kv-cache-dtype int8|fp8: backend/layers/kv_quant.py).
KV_SCALE_BYTES: dict[str, float] = {"fp8": 4, "int8": 4}
# config.json's torch_dtype, and the engine's dtype names, in the planner's terms.
TORCH_NAMES = {
    "float32": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "int8": "int8",
    "float8_e4m3fn": "fp8",
}
GIB = 2**30


@dataclass(frozen=True)
class Architecture:
    """A decoder-only transformer (Llama, Mistral, Qwen2): the shapes of its weights."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    max_context: int | None = None  # max_position_embeddings, if known
    dtype: str | None = None  # the checkpoint's precision, if known

    @classmethod
    def of(cls, name: str, cfg: ModelConfig) -> Architecture:
        return cls(
            name=name,
            num_layers=cfg.num_layers,
            hidden_size=cfg.hidden_size,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            intermediate_size=cfg.intermediate_size,
            vocab_size=cfg.vocab_size,
            tie_word_embeddings=cfg.tie_word_embeddings,
            qkv_bias=cfg.qkv_bias,
            o_bias=cfg.o_bias,
            mlp_bias=cfg.mlp_bias,
            max_context=cfg.max_position_embeddings,
            dtype=TORCH_NAMES.get(cfg.torch_dtype or ""),
        )

    def check(self) -> None:
        for flag, value in (
            ("--layers", self.num_layers),
            ("--hidden", self.hidden_size),
            ("--heads", self.num_heads),
            ("--kv-heads", self.num_kv_heads),
            ("--head-dim", self.head_dim),
            ("--intermediate", self.intermediate_size),
            ("--vocab", self.vocab_size),
        ):
            positive(flag, value)
        if self.num_heads % self.num_kv_heads:
            raise CapacityInputError(
                "--kv-heads",
                f"--kv-heads {self.num_kv_heads} does not divide --heads {self.num_heads}",
            )

    def param_count(self) -> int:
        """Embeddings, per layer attention (q: heads, k and v: kv_heads, o) and the gated
        MLP (gate, up, down) with their biases and two RMSNorms, the final norm, and the
        LM head unless it is tied to the embeddings."""
        h, q, kv = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        attention = h * q + 2 * h * kv + q * h
        if self.qkv_bias:
            attention += q + 2 * kv
        if self.o_bias:
            attention += h
        mlp = 3 * h * self.intermediate_size
        if self.mlp_bias:
            mlp += 2 * self.intermediate_size + h
        layer = attention + mlp + 2 * h
        embeddings = self.vocab_size * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return embeddings + self.num_layers * layer + h + head

    def lora_bytes_per_slot(self, rank: int, dtype: str) -> float:
        """One LoRA adapter slot as the engine holds it (backend/layers/lora.py): every
        layer's q/k/v/o/gate/up/down A [rank, in] and B [rank, out], at max_lora_rank."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        h, inter = self.hidden_size, self.intermediate_size
        ins = 3 * h + q + 2 * h + inter  # A: qkv's three shards, o, gate and up, down
        outs = q + 2 * kv + h + 2 * inter + h  # B: q, k, v, o, gate, up, down
        return self.num_layers * rank * (ins + outs) * DTYPE_BYTES[dtype]

    def kv_bytes_per_token(self, kv_dtype: str) -> float:
        """2 (K and V) x layers x kv_heads x (head_dim x bytes per element + the scale's
        bytes of a one-byte cache)."""
        per_head = self.head_dim * DTYPE_BYTES[kv_dtype] + KV_SCALE_BYTES.get(kv_dtype, 0)
        return 2 * self.num_layers * self.num_kv_heads * per_head


@dataclass(frozen=True)
class Hardware:
    """One accelerator: memory, HBM bandwidth and dense tensor FLOP/s."""

    name: str
    memory_bytes: float
    hbm_bandwidth: float  # bytes/s
    bf16_flops: float
    fp8_flops: float | None = None

    def check(self) -> None:
        positive("--gpu-memory-gb", self.memory_bytes)
        positive("--bandwidth-tbs", self.hbm_bandwidth)
        positive("--tflops", self.bf16_flops)

    def peak_flops(self, dtype: str) -> float:
        """fp8/int8 run on the fp8 tensor cores where there are some; int4 weights are
        dequantised to bf16 for the math; fp32 runs as TF32, half the bf16 rate."""
        if dtype in ("fp8", "int8") and self.fp8_flops:
            return self.fp8_flops
        if dtype == "fp32":
            return self.bf16_flops / 2
        return self.bf16_flops


def positive(flag: str, value: float) -> None:
    if not value > 0:
        raise CapacityInputError(flag, f"{flag} must be positive, got {value:g}")


def non_negative(flag: str, value: float) -> None:
    if not value >= 0:
        raise CapacityInputError(flag, f"{flag} must be zero or more, got {value:g}")
