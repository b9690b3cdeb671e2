"""Load a Hugging Face Llama-family checkpoint folder: config.json plus safetensors."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from backend.errors import CheckpointError
from backend.layers.attention import AttentionBackend
from backend.models.config import ModelConfig, read_json
from backend.models.llama import LlamaForCausalLM

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # derived buffers some old checkpoints carry


def resolve_device(requested: str) -> torch.device:
    """'auto': the first CUDA device when torch sees one, else the CPU."""
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


def resolve_dtype(requested: str, device: torch.device, cfg: ModelConfig) -> torch.dtype:
    """'auto': on the CPU, bfloat16 where the processor multiplies it natively (AVX512-BF16
    or AMX: 2-3x float32's matmul rate on the bench Llama's shapes, half the weight and KV
    bytes), else float32 (emulated half precision is slower than float32); on CUDA the
    checkpoint's half dtype, else bfloat16 where the GPU has it, else float16."""
    if requested == "auto":
        if device.type == "cpu":
            return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
        bf16 = torch.cuda.is_bf16_supported()
        if cfg.torch_dtype == "float16" or (cfg.torch_dtype == "bfloat16" and bf16):
            requested = cfg.torch_dtype
        else:
            requested = "bfloat16" if bf16 else "float16"
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[
        requested
    ]


def cpu_has_native_bf16() -> bool:
    """Whether this processor has bfloat16 dot-product instructions (AVX512-BF16, AMX).
    torch.cpu's probes are private: a torch without them means float32."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def load_model(
    model_dir: Path,
    cfg: ModelConfig,
    *,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    backend: AttentionBackend,
) -> LlamaForCausalLM:
    """Build the model without initialising weights, then fill every parameter from disk.
    The dtype is set on the meta device, so the device only ever holds the weights in
    their final dtype (materialising in float32 first took 32 GB for an 8B model), and
    each tensor is read straight onto the device (safetensors' device=), one at a time."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_positions, backend).to(dtype)
    model.to_empty(device=device)
    if cfg.tie_word_embeddings:  # materialising replaced the shared parameter; share it again
        model.lm_head.weight = model.model.embed_tokens.weight
    _load_weights(model, model_dir, device)
    return model.eval()


def _load_weights(model: LlamaForCausalLM, model_dir: Path, device: torch.device) -> None:
    params = dict(model.named_parameters())
    loaded: set[tuple[str, int]] = set()
    for file, name, tensor in _iter_tensors(model_dir, device):
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


def _iter_tensors(
    model_dir: Path, device: torch.device
) -> Iterator[tuple[Path, str, torch.Tensor]]:
    for file in _weight_files(model_dir):
        try:
            handle = safe_open(str(file), framework="pt", device=str(device))
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
