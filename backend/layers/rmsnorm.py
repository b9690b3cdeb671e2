from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional

from backend.kernels import use_fused


class RMSNorm(nn.Module):
    """On CUDA one fused Triton kernel (backend/kernels/norm.py) does the residual add and
    the norm; on the CPU torch does, in the same order of rounding (in float32 torch's
    own fused rms_norm, which gives the separate ops' results bit for bit)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_fused(x):
            from backend.kernels.norm import rms_norm  # imported on first CUDA use only

            return rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        if dtype == torch.float32:  # one fused kernel, the same roundings as the ops below
            return functional.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in float32 and cast back before scaling, exactly as Hugging Face does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); on CUDA the sum is written into residual."""
        if use_fused(x):
            from backend.kernels.norm import rms_norm

            return rms_norm(x, self.weight, self.eps, residual), residual
        total = residual + x
        return self.forward(total), total
