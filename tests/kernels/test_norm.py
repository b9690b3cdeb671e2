"""Fused RMSNorm (with and without the residual add) and SiLU-and-multiply against their
torch references, under the interpreter."""

from __future__ import annotations

import pytest
import torch

from backend.kernels.norm import rms_norm, rms_norm_reference, silu_and_mul, silu_and_mul_reference
from backend.layers.rmsnorm import RMSNorm

pytestmark = pytest.mark.interpreter

# bfloat16 is rounded twice in each kernel (as torch does) and the interpreter breaks
# rounding ties its own way: a step or two of bfloat16, 1.5% relative.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.5e-2, 1.5e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [96, 256])
def test_rms_norm_with_and_without_residual(dtype: torch.dtype, hidden: int) -> None:
    gen = torch.Generator().manual_seed(hidden)
    x, residual = torch.randn(2, 7, hidden, generator=gen).to(dtype)
    weight = torch.randn(hidden, generator=gen).to(dtype)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(
        rms_norm(x, weight, 1e-5), rms_norm_reference(x, weight, 1e-5), atol=atol, rtol=rtol
    )
    got_res, ref_res = residual.clone(), residual.clone()
    out = rms_norm(x, weight, 1e-5, got_res)
    rms_norm_reference(x, weight, 1e-5, ref_res)
    torch.testing.assert_close(got_res, ref_res, atol=atol, rtol=rtol)
    # Normalise the kernel's own sum: the interpreter breaks rounding ties of the
    # bfloat16 add its own way, and the weight would amplify that one step.
    torch.testing.assert_close(out, rms_norm_reference(got_res, weight, 1e-5), atol=atol, rtol=rtol)


def test_rms_norm_reference_is_the_layer() -> None:
    """The reference is what the model computes on the CPU, bit for bit."""
    layer = RMSNorm(64, 1e-6)
    with torch.no_grad():
        layer.weight.normal_()
    x, residual = torch.randn(2, 5, 64)
    expected = layer(x + residual)
    assert torch.equal(rms_norm_reference(x, layer.weight, 1e-6, residual.clone()), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [128, 1500])
def test_silu_and_mul(dtype: torch.dtype, width: int) -> None:
    gate_up = torch.randn(5, 2 * width, generator=torch.Generator().manual_seed(width)).to(dtype)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(
        silu_and_mul(gate_up), silu_and_mul_reference(gate_up), atol=atol, rtol=rtol
    )
