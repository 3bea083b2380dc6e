"""Rotary position embedding, NeoX (half-split) form; tables precomputed once per theta."""

from __future__ import annotations

import torch


class RotaryEmbedding:
    def __init__(self, head_dim: int, max_position: int, theta: float, device: str | torch.device) -> None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
        self.cos = freqs.cos().float().to(device)  # [max_position, head_dim / 2]
        self.sin = freqs.sin().float().to(device)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: [T, heads, head_dim]; positions: [T]
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
