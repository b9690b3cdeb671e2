"""Weight-only quantization at load: the decoder's linear layers swapped for int8 or fp8
ones after the checkpoint is loaded (gpt-fast's module swap). Weights take one byte a
parameter; activations, the KV cache, norms, embeddings and the output head keep the
engine's dtype.

int8: symmetric, one scale per output channel (row of the weight): w ~ q * s with q in
[-127, 127]. On the CPU the matmul is torch's int8 weight-only kernel
(`_weight_int8pack_mm`, bfloat16 activations: it reads a quarter of float32's weight
bytes, and on this project's CPU runs a batch-1 projection 2.8x faster than bfloat16);
on CUDA the weight is dequantized inside the matmul (a torch path: correct, half the
resident weight memory; a fused Triton kernel is the next step).

fp8: e4m3 with one scale per output channel, dequantized in the matmul, on GPUs with
fp8 (compute capability 8.9 and later: Ada, Hopper); refused elsewhere at start-up."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional

from backend.config import QUANTIZATIONS

INT8_MAX = 127
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
_FP8_CAPABILITY = (8, 9)


class QuantizationError(ValueError):
    """The quantization cannot run on this device."""


class QuantizedLinear(nn.Module):
    """y = x @ (q * s).T + b, q [out, in] in one byte, s [out] per output channel."""

    weight: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, linear: nn.Linear, method: str) -> None:
        super().__init__()
        weight = linear.weight.detach().float()
        # A row of zeros keeps a scale of 1 (its q are 0): no division by zero.
        peak = weight.abs().amax(dim=1)
        peak = torch.where(peak > 0, peak, torch.ones_like(peak))
        limit = INT8_MAX if method == "int8" else FP8_MAX
        scale = peak / limit
        scaled = weight / scale[:, None]
        if method == "int8":
            q = scaled.round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
        else:
            q = scaled.clamp_(-FP8_MAX, FP8_MAX).to(FP8)
        self.method = method
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", q)
        self.register_buffer("scale", scale.to(linear.weight.dtype))
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.method == "int8" and x.device.type == "cpu":
            # The CPU kernel takes 2-D bfloat16 (or float32, 10x slower here) activations.
            flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
            out = torch._weight_int8pack_mm(flat, self.weight, self.scale.to(torch.bfloat16))
            out = out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        else:
            out = functional.linear(x, self.weight.to(x.dtype)) * self.scale
        return out if self.bias is None else out + self.bias

    def dequantized(self) -> torch.Tensor:
        """The weight this layer computes with, in float32 (for tests and reports)."""
        return self.weight.float() * self.scale.float()[:, None]

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, {self.method}"


def check_quantization(method: str, device: torch.device) -> None:
    """Raise QuantizationError where `method` cannot run on `device`."""
    if method not in QUANTIZATIONS:
        raise QuantizationError(f"quantization must be one of {QUANTIZATIONS}, got {method!r}")
    if method != "fp8":
        return
    if device.type != "cuda":
        raise QuantizationError(
            "quantization fp8 needs a GPU with fp8 (compute capability 8.9+: Ada, Hopper); "
            f"this engine runs on {device.type}: use int8"
        )
    require_fp8(device, "quantization fp8")


def require_fp8(device: torch.device, what: str) -> None:
    """Raise QuantizationError unless the GPU `device` loads fp8 (8.9+: Ada, Hopper)."""
    capability = torch.cuda.get_device_capability(device)
    if capability < _FP8_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise QuantizationError(
            f"{what} needs compute capability 8.9+; {name} has "
            f"{capability[0]}.{capability[1]}: use int8"
        )


def quantize(model: nn.Module, method: str) -> int:
    """Swap the decoder's linear layers (attention and MLP projections) for quantized ones,
    in place; returns how many. The output head and embeddings stay as they are (tied
    to each other in small models, and the logits' precision matters most)."""
    if method == "none":
        return 0
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear) and name != "lm_head"
    ]
    for parent, name, child in targets:
        setattr(parent, name, QuantizedLinear(child, method))
    return len(targets)
