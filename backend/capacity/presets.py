"""Named models (their published config.json files, as data in data/models/) and GPUs
(data/gpus.json), and reading a model from a checkpoint folder."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

from backend.capacity.errors import CapacityInputError
from backend.capacity.model import GIB, Architecture, Hardware
from backend.errors import CheckpointError
from backend.models.config import load_model_config

PRESETS_DIR = Path(__file__).resolve().parent / "data"
MODELS_DIR = PRESETS_DIR / "models"


def model_presets() -> list[str]:
    return sorted(p.name for p in MODELS_DIR.iterdir() if (p / "config.json").is_file())


def gpu_presets() -> list[str]:
    return list(_gpus())


def _lookup(name: str, names: list[str], flag: str) -> str:
    for known in names:
        if known.lower() == name.strip().lower():
            return known
    raise CapacityInputError(flag, f"{flag} {name!r} is not a preset; one of {', '.join(names)}")


@cache
def model_preset(name: str) -> Architecture:
    """A preset by name, case-insensitive ("Llama-3-8B" or "llama-3-8b")."""
    known = _lookup(name, model_presets(), "--preset")
    return Architecture.of(known, load_model_config(MODELS_DIR / known))


def model_from_dir(folder: Path) -> Architecture:
    """The shapes in a Hugging Face checkpoint folder's config.json (no weights read)."""
    try:
        cfg = load_model_config(folder)
    except CheckpointError as exc:
        raise CapacityInputError("--model-dir", f"--model-dir: {exc}") from None
    return Architecture.of(folder.resolve().name, cfg)


@cache
def _gpus() -> dict[str, Hardware]:
    data = json.loads((PRESETS_DIR / "gpus.json").read_text(encoding="utf-8"))
    return {
        name: Hardware(
            name=name,
            memory_bytes=spec["memory_gib"] * GIB,
            hbm_bandwidth=spec["hbm_tbs"] * 1e12,
            bf16_flops=spec["bf16_tflops"] * 1e12,
            fp8_flops=spec["fp8_tflops"] * 1e12 if spec["fp8_tflops"] else None,
        )
        for name, spec in data.items()
        if not name.startswith("_")
    }


def gpu_preset(name: str) -> Hardware:
    return _gpus()[_lookup(name, gpu_presets(), "--gpu")]
