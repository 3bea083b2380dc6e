"""8-bit per-channel weights (symmetric, one scale per row). One row (decode), or a few narrow ones, runs the
C++ kernel `tokenhaul_int8::int8_gemv` (layers/int8_gemv.py: 1.2-2.3x `_weight_int8pack_mm`), other few-row cases
`_weight_int8pack_mm` (bf16 activations); more rows quantize each activation row on the fly and run the integer
GEMM `torch._int_mm` (int8 x int8, exact int32 sums), which on AVX-512 hosts is 1.5-6x the packed kernel from
8 rows on and still 2x a bf16 GEMM at 512 rows (bench/linear_kernels.py, bench/RESULTS.md "Speed run 3"); on
AVX2-only hosts `_int_mm` is a slow loop, and many rows run one fp32 GEMM on the dequantized weight instead.

Each activation row goes in as two int8 rows, hi + lo / 254 (16 bits: the product matches bf16 activations
times the int8 weight to ~3e-5 relative). One int8 row (8 bits) would be 1.2-2x faster again but costs
SmolLM2 0.8 % perplexity through its lm_head and greedy agreement with fp32 below 95 % (RESULTS)."""

from __future__ import annotations

import sys

import torch

from tokenhaul.layers import int8_gemv
from tokenhaul.layers.linear import FP32_GEMM_ROWS, Linear, Part, dequantize_part, low_precision_gemm_is_fast, register


def quantize_rows(x: torch.Tensor, split: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] → (int8 codes, fp32 scale [M, 1]). Not split: codes [M, K], x ≈ codes * scale. Split: codes
    [2M, K] = [hi; lo] with x ≈ (hi + lo / 254) * scale. |codes| <= 127 either way."""
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True).div_(127).clamp_min_(1e-30)
    u = xf.div(scale)
    if not split:
        return u.round_().to(torch.int8), scale
    m = x.shape[0]
    codes = x.new_empty(2 * m, x.shape[1], dtype=torch.int8)  # halves written in place: no fp32 concatenation
    hi = u.round()
    codes[:m].copy_(hi)
    codes[m:].copy_(u.sub_(hi).mul_(254).round_())
    return codes, scale


GEMV_ROWS_AVX2 = 128  # Zen 3, 2 threads: at 128 rows still 1.2-1.9x the fp32 GEMM (lm_heads, Qwen's layers)


@register("int8")
class Int8Linear(Linear):
    """y = (x_q @ W_q^T) * x_scale * w_scale on CPU for more than `packed_rows` rows; up to that the C++ GEMV
    where it beats int8pack (`gemv_rows`), else `_weight_int8pack_mm`; always the latter on CUDA."""

    packed_rows = 7  # int8pack ÷ int_mm(16-bit activations) crosses 1 between 4 and 8 rows (RESULTS)

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight  # int8 [out, in]
        self.scales = scales  # bf16 [out]
        self.weight_t = weight.t()  # [in, out] view: _int_mm's operand, no copy
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.cuda = weight.device.type == "cuda"
        self.widen = not low_precision_gemm_is_fast(weight.device)  # many rows: fp32 (see that function)
        if self.widen:  # int8pack up to where the fp32 GEMM (and its copy of the weight) pays
            self.packed_rows = FP32_GEMM_ROWS - 1
        self.gemv = not self.cuda and int8_gemv.available()
        # AVX2: the GEMV (8 rows a pass) beats int8pack and the fp32 GEMM up to 128 rows and more (1.2-4x)
        self.gemv_max = GEMV_ROWS_AVX2 if torch.backends.cpu.get_cpu_capability() == "AVX2" else None

    def gemv_rows(self, m: int) -> bool:
        """Whether `m` rows take the C++ GEMV. With AVX-512 it beats int8pack at one row, and at a few rows while
        M * K int16 activations stay in L1 (measured, 2 threads: 1.2-2.5x at 2-4 rows of 576-896 inputs; 1.0x and
        0.8x at 2 and 4 rows of 4864); with AVX2 up to `gemv_max` rows (bench/RESULTS.md "int4 and int8 GEMVs on
        AVX2")."""
        if not self.gemv:
            return False
        if self.gemv_max is not None:
            return m <= self.gemv_max
        k = self.in_features
        return m <= self.packed_rows and (m == 1 or (m <= int8_gemv.MAX_ROWS and m * k <= 4096))

    def pin_one_kernel(self) -> None:
        """One row-invariant kernel at every row count (--deterministic): the C++ GEMV (each row summed alike in
        any pass), else the integer GEMM (exact int32 sums)."""
        self.widen = False
        if self.gemv:
            self.gemv_max = sys.maxsize
        else:
            self.packed_rows = 0

    @classmethod
    def supports(cls, in_features: int, group: int | None) -> bool:
        return in_features % 16 == 0  # the packed kernel reads 16 inputs at a time (other widths crash in torch 2.13)

    @classmethod
    def build(cls, parts: list[Part], bias, dtype, device, group=None) -> Int8Linear:
        w = torch.cat([dequantize_part(p) for p in parts])
        scale = (w.abs().amax(dim=1) / 126.5).bfloat16().float()  # rounded up or down, |q| stays <= 127
        q = (w / torch.where(scale == 0, 1.0, scale)[:, None]).round().clamp(-127, 127).to(torch.int8)
        b = None if bias is None else bias.to(device, torch.float32)
        return cls(q.to(device), scale.to(device, torch.bfloat16), b)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        if m and self.gemv_rows(m):  # a prefill chunk that samples no row asks the lm_head for 0 rows
            y = torch.ops.tokenhaul_int8.int8_gemv(x, self.weight, self.scales)
        elif self.cuda or m <= self.packed_rows:
            y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.weight, self.scales)
        elif self.widen:  # no fast int8 GEMM here: one fp32 copy of the weight and an fp32 GEMM
            y = torch.nn.functional.linear(x.float(), self.dequantize(torch.float32))
        else:
            xq, xs = quantize_rows(x, split=True)
            hi_lo = torch._int_mm(xq, self.weight_t)  # int32 [2m, out]; only the hi half becomes a float copy
            y = hi_lo[:m].float().add_(hi_lo[m:], alpha=1 / 254).mul_(xs).mul_(self.scales)
        return self._add_bias(y).to(x.dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[out, in] at `dtype`: reads the int8 weight once and the scales once."""
        return self.weight.to(dtype).mul_(self.scales.view(-1, 1))

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight, self.scales] + ([] if self.bias is None else [self.bias])

    def state(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight, "scales": self.scales} | ({} if self.bias is None else {"bias": self.bias})

    @classmethod
    def from_state(cls, state, device) -> Int8Linear:
        bias = state.get("bias")
        return cls(state["weight"].to(device), state["scales"].to(device), None if bias is None else bias.to(device))
