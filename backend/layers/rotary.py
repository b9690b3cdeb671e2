"""Rotary position embedding (rotate-half layout), with linear and llama3 frequency scaling."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def inverse_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None
) -> torch.Tensor:
    # float32 throughout, as Hugging Face computes it, so greedy tokens match bit for bit.
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])  # type: ignore[index]
    elif rope_type == "llama3":
        inv_freq = _llama3(inv_freq, scaling)  # type: ignore[arg-type]
    return inv_freq


def _llama3(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
    factor, old_len = float(s["factor"]), float(s["original_max_position_embeddings"])
    low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.theta = theta
        self.scaling = scaling
        # A plain attribute, not a buffer: built on first use on the right device, so
        # meta-device construction and dtype casts of the model never touch it.
        self._cos_sin: torch.Tensor | None = None
        # The last step's rows of the table: every layer of a step passes the same
        # positions tensor, so the lookup (a gather and a cast) is done once per step.
        self._last: tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None = None

    def _cache(self, device: torch.device) -> torch.Tensor:
        """[max_positions, 2 * head_dim] float32: cos, then sin with its first half
        negated, each repeated to the full head width (the rotate-half layout pairs
        dimension i with i + d/2): rotate_half(x) * sin is then roll(x) * signed sin."""
        if self._cos_sin is None or self._cos_sin.device != device:
            inv_freq = inverse_frequencies(self.head_dim, self.theta, self.scaling)
            freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32), inv_freq)
            cos, sin = freqs.cos(), freqs.sin()
            self._cos_sin = torch.cat([cos, cos, -sin, sin], dim=-1).to(device)
        return self._cos_sin

    def _rows(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        last = self._last
        if last is not None and last[0] is positions and last[1] == dtype:
            return last[2], last[3]
        cos, sin = self._cache(positions.device)[positions].unsqueeze(1).to(dtype).chunk(2, dim=-1)
        self._last = (positions, dtype, cos, sin)
        return cos, sin

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim] (the query and key heads side by side: one pass for
        both), positions: [T]. Four element-wise ops; the same roundings as Hugging
        Face's x * cos + rotate_half(x) * sin, since negating is exact."""
        cos, sin = self._rows(positions, x.dtype)
        return x * cos + x.roll(self.head_dim // 2, dims=-1) * sin
