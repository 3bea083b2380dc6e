"""Token embedding: a dense table, or the GGUF blocks kept packed with only the gathered rows dequantized."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from tokenhaul.layers.gguf_weight import GGUFWeight


def _q8_0(rows: torch.Tensor) -> torch.Tensor:
    """uint8 [T, n * 34] Q8_0 blocks (fp16 scale, 32 int8) → fp32 [T, n * 32], as gguf computes it."""
    b = rows.view(rows.shape[0], -1, 34)
    d = b[..., :2].contiguous().view(torch.float16).float()
    return (b[..., 2:].contiguous().view(torch.int8).float() * d).flatten(1)


def _q5_0(rows: torch.Tensor) -> torch.Tensor:
    """uint8 [T, n * 22] Q5_0 blocks (fp16 scale, 32 high bits, 16 bytes of low nibbles) → fp32 [T, n * 32]."""
    b = rows.view(rows.shape[0], -1, 22)
    d = b[..., :2].contiguous().view(torch.float16).float()
    bits = (b[..., 2:6, None] >> torch.arange(8, dtype=torch.uint8, device=rows.device)) & 1  # [T, n, 4, 8]
    qs = b[..., 6:]
    q = torch.cat([qs & 15, qs >> 4], dim=-1) | (bits.flatten(-2) << 4)  # element j: bit j of the 32 high bits
    return ((q.float() - 16) * d).flatten(1)


TORCH_DEQUANT = {Q.Q8_0: _q8_0, Q.Q5_0: _q5_0}  # in torch: traceable by torch.compile; others go through numpy


class Embedding:
    """ids [T] → [T, hidden] at `dtype` (the activation dtype: the residual stream starts here).
    `weight` is the table one gather reads rows of (the ledger's count)."""

    def __init__(self, table: torch.Tensor | GGUFWeight, device: torch.device,
                 dtype: torch.dtype = torch.float32) -> None:
        self.packed = isinstance(table, GGUFWeight)
        self.dtype = dtype
        self.hidden = table.shape[1]
        if self.packed:
            self.qtype = table.qtype
            self.weight = torch.from_numpy(np.array(table.data)).to(device)  # uint8 [vocab, bytes_per_row]
            self.table: torch.Tensor | GGUFWeight = table  # what a tied lm_head is built from
        else:
            self.weight = self.table = table.to(device)

    def tensors(self) -> list[torch.Tensor]:
        """The table, whole (a step reads only its rows: `row_bytes` each)."""
        return [self.weight]

    @property
    def row_bytes(self) -> int:
        return self.weight.shape[1] * self.weight.element_size()

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight[ids]
        if not self.packed:
            return rows.to(self.dtype)
        if self.qtype in TORCH_DEQUANT:
            return TORCH_DEQUANT[self.qtype](rows).to(self.dtype)
        out = dequantize(rows.cpu().numpy(), self.qtype).reshape(-1, self.hidden)
        return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).to(self.weight.device, self.dtype)
