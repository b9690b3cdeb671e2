"""The built-in model that ships with Tollgate.

``tollgate-tiny`` is a small Llama-architecture checkpoint in Hugging Face format,
trained on the Python standard library's docstrings by
``scripts/train_builtin_model.py`` (fixed seed, reproducible). It lets a trial
install serve real, English-like completions with no download and no GPU.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["BUILTIN_MODEL_DIR", "BUILTIN_MODEL_NAME"]

BUILTIN_MODEL_NAME = "tollgate-tiny"
BUILTIN_MODEL_DIR: Path = Path(__file__).resolve().parent / BUILTIN_MODEL_NAME
