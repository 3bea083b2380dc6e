"""Token embedding: a dense table, or the GGUF blocks kept packed with only the gathered rows dequantized."""

from __future__ import annotations

import numpy as np
import torch
from gguf.quants import dequantize

from tokenhaul.layers.gguf_weight import GGUFWeight


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
        out = dequantize(rows.cpu().numpy(), self.qtype).reshape(-1, self.hidden)
        return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).to(self.weight.device, self.dtype)
