"""Triton kernels for the engine, each beside the torch reference it is tested against.

Nothing here is imported by the engine until a Triton backend is chosen
(`backend.layers.attention.attention_backend`) or a layer runs on CUDA, so
`TRITON_INTERPRET=1` set before that point makes every kernel run in Triton's CPU
interpreter (how the tests run them). This package file itself imports no kernel."""

from __future__ import annotations

import importlib.util
from functools import cache

import torch


@cache
def triton_available() -> bool:
    """Triton is installed (a Linux x86-64 dependency; absent elsewhere)."""
    return importlib.util.find_spec("triton") is not None


def use_fused(tensor: torch.Tensor) -> bool:
    """The layers' fused kernels run on CUDA tensors when Triton is there; the CPU keeps
    torch (no compiled Triton for a CPU, and the interpreter would be far slower)."""
    return tensor.is_cuda and triton_available()
