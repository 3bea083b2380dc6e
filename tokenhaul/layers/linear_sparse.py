"""Activation sparsity (TEAL-style, training-free): inputs under a calibrated magnitude are zeroed and the
weight rows of those inputs are never read.

The weight is stored by input channel, in column parts `[parts, in, width]` (a part's slices of every input
row lie together, read nearly in memory order; threads take parts): a skipped input's bytes are never
touched. A step of up to `max_rows` rows runs a gathered GEMV over each row's kept inputs (Σ x_i · W[i, :]
over kept i: sparse_gemv.cpp, also inside the compiled decode step, or the same sum in torch ops without a
compiler); bigger steps (prefill, batches, where the rows' kept sets together cover most inputs) run one dense
pass on the zeroed inputs (a packed format's own kernel, kept beside the rows).
Storage follows the wrapped linear's bits: float rows as they are ("dense"); "int8" codes per input channel
with an fp32 (scale, offset) per channel beside them; "int4" the wrapped Int4Linear's own codes and
(scale, zero) per (group of inputs, output), the codes laid out by input channel (nibbles along the outputs),
so the values are exactly the wrapped linear's and a skipped channel's codes are never read.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tokenhaul import native
from tokenhaul.layers.linear import Linear, low_precision_gemm_is_fast, register
from tokenhaul.layers.weight_block import gather_weights

# Rows at or under which the gathered kernel runs: bf16 rows for batch-1 and batch-2 steps, packed rows (int8, int4)
# for batch-1 decodes only. Set from the serial kernel's table (bench/bytes.py, 2026-11-30); the parallel kernel's
# crossover is not re-measured yet (its one attempt, 2026-12-01 02:04, ran beside unlocked builds: void).
MAX_ROWS = 2
MAX_ROWS_PACKED = 1
SOURCE = Path(__file__).with_name("sparse_gemv.cpp")
TILE = 1024  # most columns per part (sparse_gemv.cpp: its fp32 accumulator stays in L1)
SHIM = ("AOTITorchError aoti_torch_cpu_sparse_gemv(AtenTensorHandle x, double threshold, AtenTensorHandle rows, "
        "AtenTensorHandle* scales, int64_t out_features, int64_t group, AtenTensorHandle* bias, "  # the op as a C
        "AtenTensorHandle kept, AtenTensorHandle* out)")  # function (native.c_shims)


def part_width(n: int, threads: int) -> int:
    """Columns per part: a multiple of `threads` parts of at most TILE columns, each a multiple of 16."""
    parts = threads * -(-n // (threads * TILE))
    per_part = -(-n // parts)
    return -(-per_part // 16) * 16


def in_parts(rows: torch.Tensor, width: int) -> torch.Tensor:
    """[in, cols] → [parts, in, width] (the last part padded with zeros)."""
    k, cols = rows.shape
    parts = -(-cols // width)
    padded = torch.nn.functional.pad(rows, (0, parts * width - cols))
    return padded.view(k, parts, width).transpose(0, 1).contiguous()


def _fake(x: torch.Tensor, threshold: float, rows: torch.Tensor, scales: torch.Tensor | None, out_features: int,
          group: int, bias: torch.Tensor | None, kept: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


def _int8_rows(wt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[in, out] float → (uint8 codes [in, out], fp32 [in, 2] scale and offset): value = code * scale + offset."""
    lo, hi = wt.amin(1), wt.amax(1)
    scale = ((hi - lo) / 255).clamp_min(1e-12)
    q = ((wt - lo[:, None]) / scale[:, None]).round().clamp(0, 255).to(torch.uint8)
    return q.contiguous(), torch.stack([scale, lo], 1).contiguous()


def _int4_rows(inner: Linear) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """An Int4Linear's codes by input channel [in, out / 2] (per 16 outputs 8 bytes, byte b = q[b] | q[b + 8]
    << 4) and its (scale, zero) as [in / group, 2, out] bf16; None where it has no such groups."""
    sz, group, n = inner.torch_scales(), inner.group, inner.out_features
    if n % 16 or sz.dtype != torch.bfloat16:
        return None
    sz = sz[:, :n].float()  # [in / group, out, 2]: value = (q - 8) * scale + zero
    w = inner.dequantize(torch.float32).t().reshape(-1, group, n)  # [in / group, group, out]
    scale, zero = sz[..., 0][:, None], sz[..., 1][:, None]
    q = ((w - zero) / torch.where(scale == 0, 1.0, scale) + 8).round().clamp(0, 15).to(torch.uint8)
    q = q.reshape(-1, n // 16, 2, 8)
    rows = (q[:, :, 0] | q[:, :, 1] << 4).reshape(-1, n // 2)
    return rows.contiguous(), sz.permute(0, 2, 1).contiguous().to(torch.bfloat16), group


@register("sparse")
class SparseLinear(Linear):
    """Wraps a built linear's weight as input-channel rows with a threshold; see the module docstring."""

    def __init__(self, rows: torch.Tensor, storage: str, threshold: float, out_features: int,
                 bias: torch.Tensor | None, max_rows: int = MAX_ROWS, sparsity: float = 0.0,
                 packed: Linear | None = None, scales: torch.Tensor | None = None, group: int = 0) -> None:
        """`rows`: [in, out] float, [in, out] uint8 (int8) or [in, out / 2] uint8 (int4), stored in parts."""
        width = part_width(out_features, torch.get_num_threads())
        self.rows = in_parts(rows, width // 2 if storage == "int4" else width)  # [parts, in, width (/ 2)]
        self.storage = storage  # "dense", "int8" or "int4"
        self.scales = scales  # int8: fp32 [in, 2]; int4: bf16 [in / group, 2, out]
        self.group = group
        self.threshold = threshold
        self.out_features = out_features
        self.in_features = rows.shape[0]
        self.row_cols = rows.shape[1]  # stored columns of one input row (int4: bytes, two codes each)
        self.bias = bias
        self.max_rows = max_rows
        self.sparsity = sparsity  # the calibrated target share of inputs under the threshold (for the ledger)
        self.packed = packed  # the wrapped packed linear: the dense pass for steps over max_rows
        self.kept = torch.zeros(2, dtype=torch.long)  # the kernel's own count: kept channels, int4 groups read
        self.dense_bytes = 0
        self.widen = not low_precision_gemm_is_fast(rows.device)  # the dense pass in fp32 (see there)
        self.fused = (storage != "dense" or rows.dtype == torch.bfloat16) and native.load(
            SOURCE, "sparse GEMVs run as several torch ops instead (slower)", {"tokenhaul_sparse::sparse_gemv": _fake},
            parallel=True, shims={"tokenhaul_sparse::sparse_gemv": SHIM})

    @classmethod
    def wrap(cls, inner: Linear, threshold: float, max_rows: int | None = None,
             sparsity: float = 0.0) -> SparseLinear:
        """Same bits as `inner`: dense stays at its dtype, int8 becomes int8 per input channel, int4 keeps its
        own codes and group scales (other packed formats: int8 per input channel)."""
        packed, scales, group = inner, None, 0
        int4 = _int4_rows(inner) if inner.format == "int4" else None
        if inner.format == "dense":  # fp32 dense is already stored [in, out]
            w = inner.weight
            rows, storage, packed = (w if inner.transposed else w.t()).contiguous(), "dense", None
        elif int4 is not None:
            (rows, scales, group), storage = int4, "int4"
        else:
            (rows, scales), storage = _int8_rows(inner.dequantize(torch.float32).t()), "int8"
        if max_rows is None:
            max_rows = MAX_ROWS if packed is None else MAX_ROWS_PACKED
        return cls(rows, storage, threshold, inner.out_features, inner.bias, max_rows, sparsity, packed, scales,
                   group)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.max_rows:
            if self.fused:  # one C++ call: find the kept inputs, read their rows, add the bias
                return torch.ops.tokenhaul_sparse.sparse_gemv(x.contiguous(), self.threshold, self.rows, self.scales,
                                                              self.out_features, self.group, self.bias, self.kept)
            return self.reference(x).to(x.dtype)
        xz = torch.where(x.abs() >= self.threshold, x, 0)
        self.dense_bytes += self.weight_bytes
        if self.packed is not None:
            return self.packed(xz)
        dtype = torch.float32 if self.widen else self.rows.dtype
        y = (xz.to(dtype) @ self.rows.to(dtype)).transpose(0, 1).reshape(x.shape[0], -1)[:, :self.out_features]
        return self._add_bias(y.float()).to(x.dtype)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The gathered GEMV in torch ops (fp32 out): each row reads its kept inputs' rows (no compiler; tests)."""
        out = []
        for xr in x.float():
            cols = (xr.abs() >= self.threshold).nonzero().flatten()
            self.kept[0] += cols.numel()
            if self.storage == "int4":
                self.kept[1] += cols.div(self.group, rounding_mode="floor").unique().numel()
            out.append(xr[cols] @ self.dequantized_rows(cols))
        return self._add_bias(torch.stack(out))

    def rows_of(self, cols: torch.Tensor) -> torch.Tensor:
        """The stored rows of input channels `cols` as [len(cols), stored columns] (only those rows read)."""
        parts, _, width = self.rows.shape
        return self.rows[:, cols].transpose(0, 1).reshape(len(cols), parts * width)[:, :self.row_cols]

    def dequantized_rows(self, cols: torch.Tensor) -> torch.Tensor:
        """The fp32 weight rows of input channels `cols`, [len(cols), out]."""
        r = self.rows_of(cols)
        if self.storage == "dense":
            return r.float()
        if self.storage == "int8":
            s = self.scales[cols]
            return r.float() * s[:, :1] + s[:, 1:]
        r = r.view(-1, self.out_features // 16, 8)
        q = torch.stack([r & 15, r >> 4], 2).reshape(-1, self.out_features)  # per 16 outputs: 8 low, 8 high
        sz = self.scales[cols.div(self.group, rounding_mode="floor")].float()  # [len, 2, out]
        return (q.float() - 8) * sz[:, 0] + sz[:, 1]

    @property
    def row_bytes(self) -> int:
        """Bytes read per kept input channel (int8: its scale and offset included; int4: its codes only)."""
        return self.row_cols * self.rows.element_size() + (8 if self.storage == "int8" else 0)

    @property
    def weight_bytes(self) -> int:
        """What a dense pass reads: every row (not the parts' padding), the int4 group scales, the bias."""
        extra = [t for t in (self.scales if self.storage == "int4" else None, self.bias) if t is not None]
        return self.in_features * self.row_bytes + sum(t.nbytes for t in extra)

    @property
    def touched_bytes(self) -> int:
        """Weight bytes the kernels read since the last reset (tests, bench/bytes.py)."""
        group_bytes = 4 * self.out_features if self.storage == "int4" else 0
        return int(self.kept[0]) * self.row_bytes + int(self.kept[1]) * group_bytes + self.dense_bytes

    @touched_bytes.setter
    def touched_bytes(self, value: int) -> None:
        assert value == 0, "reset only"
        self.kept.zero_()
        self.dense_bytes = 0

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.rows, self.scales, self.bias) if t is not None]


SPARSE_LINEARS = ("qkv", "o", "gate_up", "down")  # every projection of a layer; and the lm_head, keyed "lm_head"


def sparsify(model, thresholds: dict[str, float], sparsity: float, max_rows: int | None = None) -> None:
    """Replace each layer projection named in `thresholds` ("blk.{i}.{name}") by its SparseLinear; their rows
    then move into one huge-page block, as the dense weights did at load (layers/weight_block.py)."""
    wrapped: list[SparseLinear] = []
    for i, layer in enumerate(model.layers):
        for name in SPARSE_LINEARS:
            key = f"blk.{i}.{name}"
            if key in thresholds and hasattr(layer, name):
                wrapped.append(SparseLinear.wrap(getattr(layer, name), thresholds[key], max_rows, sparsity))
                setattr(layer, name, wrapped[-1])
    if "lm_head" in thresholds:  # a tied 0.5B head is 28 % of the int8 bytes: dense, it held the saving under 30 %
        model.lm_head = SparseLinear.wrap(model.lm_head, thresholds["lm_head"], max_rows, sparsity)
        wrapped.append(model.lm_head)
    gather_weights(wrapped)
