"""Dense (unquantized) linear: the exact path for `--quantization none` and for float tensors. bf16 weights on the
CPU take the C++ few-row GEMV (layers/bf16_gemv.py) up to 8 rows: 1.2-2.2x torch's bf16 `F.linear` there."""

from __future__ import annotations

import sys

import torch

from tokenhaul.layers import bf16_gemv
from tokenhaul.layers.linear import FP32_GEMM_ROWS, Linear, Part, dequantize_part, low_precision_gemm_is_fast, register


@register("dense")
class DenseLinear(Linear):
    """Unquantized weights. fp32 is stored transposed [in, out]: `x @ Wt` streams faster on CPU GEMV
    (10-11 GB/s vs 6-7.5 for the [out, in] layout, see MACHINE.md); bf16 keeps [out, in]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, transposed: bool | None = None) -> None:
        if transposed is None:
            transposed = weight.dtype == torch.float32 and weight.device.type == "cpu"
            weight = weight.t().contiguous() if transposed else weight.contiguous()
        self.transposed = transposed
        self.in_features, self.out_features = weight.shape if transposed else weight.shape[::-1]
        self.weight = weight
        self.bias = bias
        self.widen = weight.dtype == torch.bfloat16 and not low_precision_gemm_is_fast(weight.device)
        self.gemv = (weight.dtype == torch.bfloat16 and not transposed and weight.device.type == "cpu"
                     and bf16_gemv.available())
        self.gemv_rows = bf16_gemv.MAX_ROWS  # the GEMV up to here (pin_one_kernel: every count)
        self.row_by_row = False  # pinned without the GEMV: one F.linear call per row (the same kernel)

    def pin_one_kernel(self) -> None:
        """One row-invariant kernel at every row count (--deterministic). torch's bf16 F.linear is not (oneDNN
        picks its kernel by row count: SmolLM2's 1536→576 down projection differs at 64 rows), so bf16 takes the
        C++ GEMV, whose passes of up to 8 rows sum each row alike, at every count; without it one F.linear call
        per row. fp32 keeps torch's GEMM (not row-invariant in the last bits from 8 rows: README)."""
        self.widen = False
        if self.weight.dtype != torch.float32:
            self.gemv_rows = sys.maxsize
            self.row_by_row = not self.gemv

    @classmethod
    def build(cls, parts: list[Part], bias, dtype, device, group=None) -> DenseLinear:
        if len(parts) == 1 and isinstance(parts[0], torch.Tensor) and parts[0].dtype == dtype:
            w = parts[0].to(device)  # shares storage with the caller (a tied embedding stays one copy)
        else:
            w = torch.cat([dequantize_part(p) for p in parts]).to(device, dtype)
        return cls(w, None if bias is None else bias.to(device, torch.float32))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemv and 0 < x.shape[0] <= self.gemv_rows:  # 1 row: 2.2x F.linear, 8 rows 1.2x, 16 0.6x
            return self._add_bias(torch.ops.tokenhaul_bf16.bf16_gemv(x, self.weight)).to(x.dtype)
        if self.row_by_row and x.shape[0] > 1:
            return torch.cat([self(row) for row in x.split(1)])
        if self.widen and x.shape[0] >= FP32_GEMM_ROWS:  # one fp32 copy of the weight beats a slow bf16 GEMM
            y = torch.nn.functional.linear(x.float(), self.weight.float())
            return self._add_bias(y).to(x.dtype)
        w = x.to(self.weight.dtype)
        y = w @ self.weight if self.transposed else torch.nn.functional.linear(w, self.weight)
        return self._add_bias(y).to(x.dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight] + ([] if self.bias is None else [self.bias])

    def state(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight} | ({} if self.bias is None else {"bias": self.bias})

    @classmethod
    def from_state(cls, state, device) -> DenseLinear:
        w = state["weight"].to(device)
        return cls(w, state.get("bias"), transposed=w.dtype == torch.float32 and device.type == "cpu")
