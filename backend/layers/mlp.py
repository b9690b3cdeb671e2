from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional

from backend.kernels import use_fused


class GatedMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if use_fused(gate_up):  # one fused Triton kernel instead of silu, then a multiply
            from backend.kernels.norm import silu_and_mul  # imported on first CUDA use only

            return self.down_proj(silu_and_mul(gate_up))  # type: ignore[no-any-return]
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(functional.silu(gate) * up)  # type: ignore[no-any-return]
