"""A GGUF tensor kept as the file stores it (quantized blocks), dequantized only on request."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K, dequantize


@dataclass
class GGUFWeight:
    """A 2-D weight [rows, cols] as raw blocks: `data` is uint8 [rows, bytes_per_row] (float types: the values).
    Blocks run along cols, so rows are independent: permuting or gathering rows never touches a block."""

    qtype: GGMLQuantizationType
    shape: tuple[int, int]
    data: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    @property
    def type_name(self) -> str:
        return self.qtype.name

    def permute_rows(self, perm: np.ndarray) -> GGUFWeight:
        return GGUFWeight(self.qtype, self.shape, np.ascontiguousarray(self.data[perm]))

    def dequantize(self, rows: np.ndarray | slice | None = None) -> torch.Tensor:
        """fp32 [rows, cols], exactly as `gguf.quants.dequantize` computes it (optionally only some rows)."""
        data = self.data if rows is None else self.data[rows]
        out = dequantize(data, self.qtype).reshape(-1, self.shape[1])
        return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32))

    def int4_groups(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For types on a 4-bit grid with 32-wide groups (Q4_0, Q4_1, Q4_K sub-blocks): per-group
        (scale, offset), each fp32 [rows, cols / 32], with value = scale * q + offset, q in 0..15. Else None."""
        parse = _INT4_GRIDS.get(self.qtype)
        if parse is None:
            return None
        block, size = GGML_QUANT_SIZES[self.qtype]
        blocks = self.data.reshape(-1, size)
        scale, offset = parse(blocks)
        rows = self.shape[0]
        return (torch.from_numpy(scale.reshape(rows, -1).astype(np.float32)),
                torch.from_numpy(offset.reshape(rows, -1).astype(np.float32)))


def _f16(b: np.ndarray) -> np.ndarray:
    return b.copy().view(np.float16).astype(np.float32)[:, 0]


def _q4_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    d = _f16(blocks[:, 0:2])
    return d, -8 * d


def _q4_1(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
    return d[:, None] * sc.astype(np.float32), -(dmin[:, None] * m.astype(np.float32))  # [blocks, 8] each


_INT4_GRIDS = {GGMLQuantizationType.Q4_0: _q4_0, GGMLQuantizationType.Q4_1: _q4_1, GGMLQuantizationType.Q4_K: _q4_k}


def from_reader_tensor(t) -> GGUFWeight | torch.Tensor:
    """A gguf ReaderTensor → GGUFWeight for 2-D weights, fp32 torch tensor for 1-D ones (norms, biases)."""
    if len(t.shape) == 1:
        return torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
    cols, rows = (int(x) for x in t.shape[:2])  # GGUF lists dims innermost first
    return GGUFWeight(t.tensor_type, (rows, cols), np.asarray(t.data).reshape(rows, -1))
