"""Fused RMSNorm (with the residual add) and SiLU-and-multiply, with torch references.

Both round exactly where the torch layers round (Hugging Face's order): the residual sum
is taken in the model's dtype, normalised in float32, cast back, then scaled by the
weight; silu(gate) is cast to the dtype before the multiply."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    stride_x,
    stride_r,
    stride_o,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per row. With a residual: residual <- x + residual (in place), and the
    row normalised is that sum."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < hidden
    # Arithmetic in float32 only, rounding to the dtype where torch would: the
    # interpreter cannot add bfloat16 values directly.
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
        total = (x + r).to(dtype, fp_downcast_rounding="rtne")
        tl.store(residual_ptr + row * stride_r + cols, total, mask=ok)
        x = total.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, 0) / hidden + eps)  # x * rsqrt(mean(x^2) + eps), as HF
    normed = (x * inv_rms).to(dtype, fp_downcast_rounding="rtne").to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row * stride_o + cols,
        (weight * normed).to(dtype, fp_downcast_rounding="rtne"),
        mask=ok,
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """x: [T, hidden]. Returns weight * norm(x + residual); with a residual, the residual
    tensor is updated in place to x + residual."""
    out = torch.empty_like(x)
    if x.shape[0] == 0:
        return out
    hidden = x.shape[-1]
    _rms_norm_kernel[(x.shape[0],)](
        x,
        x if residual is None else residual,
        weight,
        out,
        x.stride(0),
        x.stride(0) if residual is None else residual.stride(0),
        out.stride(0),
        hidden,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=triton.next_power_of_2(hidden),
    )
    return out


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    if residual is not None:
        residual.add_(x)
        x = residual
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * normed


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + width + cols, mask=ok, other=0.0)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype, fp_downcast_rounding="rtne").to(tl.float32)
    tl.store(
        out_ptr + row * stride_out + cols,
        (act * up.to(tl.float32)).to(dtype, fp_downcast_rounding="rtne"),
        mask=ok,
    )


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2 * width] (gate first) -> silu(gate) * up, [T, width]."""
    tokens, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(tokens, width, dtype=gate_up.dtype, device=gate_up.device)
    if tokens == 0:
        return out
    block = min(1024, triton.next_power_of_2(width))
    _silu_and_mul_kernel[(tokens, triton.cdiv(width, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), width, BLOCK=block
    )
    return out


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
