"""A checkpoint's config.json, read into the ModelConfig the Llama family needs. No torch
here: the gateway reads checkpoints' files too, and a gateway that fronts remote replicas
never loads torch."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backend.errors import CheckpointError

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    """The parts of a Hugging Face config.json that the Llama family needs."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int  # already capped by a sliding window, if any
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    torch_dtype: str | None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(path, "file not found")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(path, f"unreadable JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(path, "expected a JSON object")
    return data


def load_model_config(model_dir: Path) -> ModelConfig:
    path = model_dir / "config.json"
    cfg = read_json(path)
    arch = (cfg.get("architectures") or ["<none>"])[0]
    if arch not in ARCHITECTURES:
        raise CheckpointError(
            path, f"unsupported architecture {arch!r}; use one of {ARCHITECTURES}"
        )
    method = (cfg.get("quantization_config") or {}).get("quant_method")
    if method is not None:  # compressed-tensors, fp8, gptq, awq...: weights we cannot read
        raise CheckpointError(
            path,
            f"a pre-quantized checkpoint ({method}) is not loaded; serve the unquantized "
            "checkpoint with --quantization int8 or fp8 (weights quantized at load)",
        )
    try:
        return _parse_config(arch, cfg)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(path, f"invalid or missing field: {exc!r}") from exc


def _parse_config(arch: str, cfg: dict[str, Any]) -> ModelConfig:
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {cfg['hidden_act']!r} (only silu)")
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads {heads} not a multiple of kv heads {kv_heads}")
    # Newer transformers nest rope settings in `rope_parameters`; older ones use two keys.
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} (supported: {SUPPORTED_ROPE_TYPES})")
    max_pos = int(cfg["max_position_embeddings"])
    window = cfg.get("sliding_window")
    if window and (arch != "Qwen2ForCausalLM" or cfg.get("use_sliding_window")):
        max_pos = min(max_pos, int(window))  # full attention equals windowed within the window
    attention_bias = bool(cfg.get("attention_bias", False))
    return ModelConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        rope_scaling={**rope, "rope_type": rope_type} if rope_type != "default" else None,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,  # Qwen2 always has q/k/v bias
        o_bias=arch != "Qwen2ForCausalLM" and attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
    )
