"""Activation sparsity (TEAL-style, training-free): inputs under a calibrated magnitude are zeroed and the
weight columns of those inputs are never read.

The weight is stored by input channel, `[in, out]`: one contiguous row per input, so a skipped input's
bytes are never touched. A step of up to `max_rows` rows runs a gathered GEMV over each row's kept inputs
(Σ x_i · W[i, :] over kept i, no copy of the rows: sparse_gemv.cpp for bf16 and int8 rows, `embedding_bag`
otherwise); bigger steps (prefill, batches, where the rows' kept sets together cover most inputs) run one
dense pass on the zeroed inputs (a packed format's own kernel, kept beside the rows).
Storage follows the wrapped linear's bits: float rows as they are ("dense"); "int8" rows quantized per
input channel (fbgemm's rowwise layout: uint8 values then an fp32 scale and offset per row); "int4" rows
split into groups of GROUP4 outputs, each 4-bit with an fp16 scale and offset (4.5 bits per weight), one
bag per output group (the gathered rows of a group stay contiguous: 36 bytes).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from tokenhaul import native
from tokenhaul.layers.linear import Linear, register

# Rows at or under which the gathered kernel runs: bench/bytes.py's kernel table (all 120 SmolLM2 projections,
# sparsity 0.4, quiet machine, 2026-11-30 22:35, fused kernel): dense / gathered time at M=1, 2, 4 rows: bf16
# 1.56, 1.03, 0.76; int8 0.88, 0.73, 0.57 (int8pack's GEMV streams ~10 GB/s; gathered rowwise-int8 rows do
# not beat it even at 40 % fewer bytes). 4-bit bags: 0.18x dense int4 at M=1: bytes fall, time does not.
MAX_ROWS = 2
# int8 (and int4) rows gather only for batch-1 decodes; bigger steps run the packed linear itself (kept beside
# the rows) on the zeroed inputs: 8 rows cost 0.59x a dense int8pack pass gathered, ~2x through dequantized rows.
MAX_ROWS_PACKED = 1
GROUP4 = 64  # outputs per 4-bit row group
SOURCE = Path(__file__).with_name("sparse_gemv.cpp")


def _rowwise_int8(wt: torch.Tensor) -> torch.Tensor:
    """[in, out] float → fbgemm rowwise int8 [in, out + 8] (per-row fp32 scale and offset appended)."""
    return torch.ops.quantized.embedding_bag_byte_prepack(wt.float().contiguous())


@register("sparse")
class SparseLinear(Linear):
    """Wraps a built linear's weight as input-channel rows with a threshold; see the module docstring."""

    def __init__(self, rows: torch.Tensor, storage: str, threshold: float, out_features: int,
                 bias: torch.Tensor | None, max_rows: int = MAX_ROWS, sparsity: float = 0.0,
                 packed: Linear | None = None) -> None:
        self.rows = rows  # [in, out] (bf16 / fp32) or [in, out + 8] uint8 rowwise int8
        self.storage = storage  # "dense" (float rows) or "int8"
        self.threshold = threshold
        self.out_features = out_features
        self.groups = out_features // GROUP4 if storage == "int4" else 1  # stored rows per input channel
        self.in_features = rows.shape[0] // self.groups
        self.bias = bias
        self.max_rows = max_rows
        self.sparsity = sparsity  # the calibrated target share of inputs under the threshold (for the ledger)
        self.touched_bytes = 0  # bytes of weight rows the kernels read since the last reset (tests, bench)
        self.packed = packed  # the wrapped packed linear: the dense pass for steps over max_rows
        # int8 and bf16 rows have a fused gathered GEMV (sparse_gemv.cpp): the torch path below costs ~10 small
        # ops per call, which ate the bytes it saved on a quiet machine (int8: 0.78x dense, bench/bytes.py)
        self.fused = (storage == "int8" or rows.dtype == torch.bfloat16) and native.load(
            SOURCE, "sparse GEMVs run as several torch ops instead (slower)")

    @classmethod
    def wrap(cls, inner: Linear, threshold: float, max_rows: int | None = None,
             sparsity: float = 0.0) -> SparseLinear:
        """Same bits as `inner`: dense stays at its dtype, packed formats (int8, int4) become rowwise int8
        (int4 has no gathered kernel here; rowwise int8 is the nearest that does)."""
        if inner.format == "dense":  # fp32 dense is already stored [in, out]
            w = inner.weight
            rows, storage = (w if inner.transposed else w.t()).contiguous(), "dense"
        elif inner.format == "int4" and inner.out_features % GROUP4 == 0:
            wt = inner.dequantize(torch.float32).t().reshape(-1, GROUP4)  # [in * out / G, G]
            rows, storage = torch.ops.quantized.embedding_bag_4bit_prepack(wt.contiguous()), "int4"
        else:
            rows, storage = _rowwise_int8(inner.dequantize(torch.float32).t()), "int8"
        packed = inner if storage != "dense" else None
        if max_rows is None:
            max_rows = MAX_ROWS if packed is None else MAX_ROWS_PACKED
        return cls(rows, storage, threshold, inner.out_features, inner.bias, max_rows, sparsity, packed)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.max_rows and self.fused:  # one C++ call: find the kept inputs, read their rows
            y, kept = torch.ops.tokenhaul_sparse.gemv(x.float().contiguous(), self.threshold, self.rows,
                                                      self.out_features)
            self.touched_bytes += int(kept.sum()) * self.row_bytes
            return self._add_bias(y).to(x.dtype)
        keep = x.abs() >= self.threshold
        if x.shape[0] > self.max_rows and self.packed is not None:
            self.touched_bytes += self.rows.nbytes  # the same weights in the packed layout, all of them
            return self.packed(torch.where(keep, x, 0))
        if x.shape[0] > self.max_rows:
            return self._add_bias(self._dense(torch.where(keep, x, 0))).to(x.dtype)
        if x.shape[0] == 1:  # batch-1 decode: fewer small ops
            cols = keep[0].nonzero().flatten()
            rows, offsets = torch.zeros_like(cols), cols.new_zeros(1)
        else:
            rows, cols = keep.nonzero(as_tuple=True)
            offsets = torch.searchsorted(rows, torch.arange(x.shape[0], device=x.device))
        self.touched_bytes += cols.numel() * self.row_bytes
        if self.storage == "int4":  # one bag per output group j: rows i * groups + j over the kept inputs i
            j = torch.arange(self.groups, device=x.device).view(-1, 1)
            ends = torch.cat([offsets[1:], offsets.new_tensor([cols.numel()])])
            y = torch.stack([self._bags4(cols[s:e], x[r, cols[s:e]].float(), j)
                             for r, (s, e) in enumerate(zip(offsets.tolist(), ends.tolist()))])
        elif self.storage == "int8":
            y = torch.ops.quantized.embedding_bag_byte_rowwise_offsets(
                self.rows, cols, offsets, False, 0, False, x[rows, cols].float())
        else:
            y = F.embedding_bag(cols, self.rows, offsets, mode="sum",
                                per_sample_weights=x[rows, cols].to(self.rows.dtype))
        return self._add_bias(y.float()).to(x.dtype)

    def _bags4(self, cols: torch.Tensor, w: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        idx = (cols.view(1, -1) * self.groups + j).flatten()  # group-major: bag j holds group j of each row
        offsets = j.flatten() * cols.numel()
        return torch.ops.quantized.embedding_bag_4bit_rowwise_offsets(
            self.rows, idx, offsets, False, 0, False, w.repeat(self.groups)).flatten()

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        self.touched_bytes += self.rows.nbytes
        return (x.to(self.rows.dtype) @ self.rows).float()

    @property
    def row_bytes(self) -> int:
        """Bytes of one input channel's row (int8: its scale and offset included)."""
        return self.rows.shape[1] * self.rows.element_size() * self.groups

    def tensors(self) -> list[torch.Tensor]:
        return [self.rows] + ([] if self.bias is None else [self.bias])


SPARSE_LINEARS = ("qkv", "o", "gate_up", "down")  # every projection of a layer; and the lm_head, keyed "lm_head"


def sparsify(model, thresholds: dict[str, float], sparsity: float, max_rows: int | None = None) -> None:
    """Replace each layer projection named in `thresholds` ("blk.{i}.{name}") by its SparseLinear."""
    if any(getattr(v, "format", "") == "int4" for layer in model.layers for v in vars(layer).values()):
        print("tokenhaul: --sparsity with int4 weights reads fewer bytes but decodes slower here (4-bit gathered "
              "kernel, bench/bytes.py); --quantization int8 or none gain speed", file=sys.stderr)
    for i, layer in enumerate(model.layers):
        for name in SPARSE_LINEARS:
            key = f"blk.{i}.{name}"
            if key in thresholds and hasattr(layer, name):
                setattr(layer, name, SparseLinear.wrap(getattr(layer, name), thresholds[key], max_rows,
                                                                  sparsity))
    if "lm_head" in thresholds:  # a tied 0.5B head is 28 % of the int8 bytes: dense, it held the saving under 30 %
        model.lm_head = SparseLinear.wrap(model.lm_head, thresholds["lm_head"], max_rows, sparsity)
