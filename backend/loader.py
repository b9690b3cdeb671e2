"""Load a Hugging Face Llama-family checkpoint folder: config.json plus safetensors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from backend.errors import CheckpointError
from backend.layers.attention import AttentionBackend
from backend.layers.rotary import SUPPORTED_ROPE_TYPES
from backend.models.config import ModelConfig
from backend.models.llama import LlamaForCausalLM

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # derived buffers some old checkpoints carry


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


def resolve_device(requested: str) -> torch.device:
    """'auto': the first CUDA device when torch sees one, else the CPU."""
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


def resolve_dtype(requested: str, device: torch.device, cfg: ModelConfig) -> torch.dtype:
    """'auto': float32 on the CPU (its half-precision matmuls are slow and often
    unsupported); on CUDA the checkpoint's half dtype, else bfloat16 where the GPU has it,
    else float16."""
    if requested == "auto":
        if device.type == "cpu":
            return torch.float32
        bf16 = torch.cuda.is_bf16_supported()
        if cfg.torch_dtype == "float16" or (cfg.torch_dtype == "bfloat16" and bf16):
            requested = cfg.torch_dtype
        else:
            requested = "bfloat16" if bf16 else "float16"
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[
        requested
    ]


def load_model(
    model_dir: Path,
    cfg: ModelConfig,
    *,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    backend: AttentionBackend,
) -> LlamaForCausalLM:
    """Build the model without initialising weights, then fill every parameter from disk."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_positions, backend)
    model.to_empty(device=device).to(dtype)
    if cfg.tie_word_embeddings:  # materialising replaced the shared parameter; share it again
        model.lm_head.weight = model.model.embed_tokens.weight
    _load_weights(model, model_dir)
    return model.eval()


def _load_weights(model: LlamaForCausalLM, model_dir: Path) -> None:
    params = dict(model.named_parameters())
    loaded: set[tuple[str, int]] = set()
    for file, name, tensor in _iter_tensors(model_dir):
        if name.endswith(_IGNORED_SUFFIXES) or (
            name == "lm_head.weight" and model.cfg.tie_word_embeddings
        ):
            continue
        target, shard = _target(model, name)
        if target not in params:
            raise CheckpointError(file, f"unexpected tensor {name!r}")
        param = params[target].data
        if shard is not None:
            fused, index = shard
            sizes = model.shard_sizes(fused)
            param = param.narrow(0, sum(sizes[:index]), sizes[index])
        if tuple(tensor.shape) != tuple(param.shape):
            raise CheckpointError(
                file,
                f"shape mismatch for {name!r}: {tuple(tensor.shape)}, "
                f"model expects {tuple(param.shape)}",
            )
        param.copy_(tensor)
        loaded.add((target, shard[1] if shard else 0))
    _check_complete(model, params, loaded, model_dir)


def _target(model: LlamaForCausalLM, name: str) -> tuple[str, tuple[str, int] | None]:
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in model.packed_weights:
            fused, shard = model.packed_weights[part]
            parts[i] = fused
            return ".".join(parts), (fused, shard)
    return name, None


def _check_complete(
    model: LlamaForCausalLM,
    params: dict[str, torch.nn.Parameter],
    loaded: set[tuple[str, int]],
    model_dir: Path,
) -> None:
    for name in params:
        if name == "lm_head.weight" and model.cfg.tie_word_embeddings:
            continue
        fused = name.split(".")[-2]
        shards = len(model.shard_sizes(fused)) if fused in ("qkv_proj", "gate_up_proj") else 1
        if any((name, s) not in loaded for s in range(shards)):
            raise CheckpointError(model_dir, f"checkpoint has no tensor for parameter {name!r}")


def _iter_tensors(model_dir: Path) -> Iterator[tuple[Path, str, torch.Tensor]]:
    for file in _weight_files(model_dir):
        try:
            handle = safe_open(str(file), framework="pt")
        except Exception as exc:  # safetensors raises its own untyped errors
            raise CheckpointError(file, f"unreadable safetensors file: {exc}") from exc
        with handle as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                yield file, name, f.get_tensor(name)


def _weight_files(model_dir: Path) -> list[Path]:
    single, index = model_dir / "model.safetensors", model_dir / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if not index.is_file():
        raise CheckpointError(
            single, "file not found (nor model.safetensors.index.json; only safetensors load)"
        )
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(index, "missing or empty 'weight_map'")
    files = [model_dir / f for f in sorted(set(weight_map.values()))]
    for f in files:
        if not f.is_file():
            raise CheckpointError(f, f"file not found (listed in {index.name})")
    return files
