"""Rotary position embedding, NeoX (half-split) form; tables precomputed once per theta."""

from __future__ import annotations

import torch


class RotaryEmbedding:
    """cos / sin tables computed in fp64, stored at the activation dtype (as transformers casts them)."""

    def __init__(self, head_dim: int, max_position: int, theta: float, device: str | torch.device,
                 dtype: torch.dtype = torch.float32) -> None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        self.cos = torch.cat((cos, cos), -1).to(device, dtype)  # [max_position, head_dim]
        self.sin = torch.cat((-sin, sin), -1).to(device, dtype)  # signed: x * cos + rotate_half(x) * sin

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, head_dim] for the step's positions: gathered once, shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim] (q and k heads together in one call) → rotated, same shape."""
        x1, x2 = x.chunk(2, dim=-1)
        return torch.addcmul(x * cos, torch.cat((x2, x1), dim=-1), sin)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.apply(x, *self.tables(positions))
