"""4-bit groupwise weights on PyTorch's packed int4 kernels (bf16 activations).

Value = (q - 8) * scale + zero per group of `group` inputs, q in 0..15. GGUF Q4_0 / Q4_1 / Q4_K blocks
(32-wide groups) map onto this without loss beyond bf16 scales; anything else is requantized min/max."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from tokenhaul.layers import int4_dequant, int4_gemv
from tokenhaul.layers.gguf_weight import GGUFWeight
from tokenhaul.layers.linear import Linear, Part, dequantize_part, low_precision_gemm_is_fast, register

PAD_N = 64  # rows are padded to a multiple of every block size below


def block_n() -> int | None:
    """Rows per block of torch's CPU int4pack layout, which follows the kernels torch dispatches to: 64 with
    AVX-512 (byte j of input k = q[j] | q[j + 32] << 4), 32 with AVX2 (q[j] | q[j + 16] << 4); None for the
    scalar build (adjacent rows paired), which tokenhaul does not read."""
    return {"AVX512": 64, "AVX2": 32}.get(torch.backends.cpu.get_cpu_capability())


def groups_of(p: Part, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One part → (q uint8 [out, in], scale, offset fp32 [out, in / group]) with value = scale * q + offset.
    GGUF 4-bit blocks at group 32 keep their own scales (exact); everything else: min/max per group."""
    w = dequantize_part(p)
    rows, cols = w.shape
    grid = p.int4_groups() if isinstance(p, GGUFWeight) and group == 32 else None
    wg = w.view(rows, cols // group, group)
    if grid is not None:
        scale, offset = grid
        safe = torch.where(scale == 0, torch.ones_like(scale), scale)
        q = ((wg - offset[..., None]) / safe[..., None]).round()
    else:  # scale and zero rounded to bf16 first, so the codes fit the values the kernel will use
        lo, hi = wg.amin(-1), wg.amax(-1)
        scale = ((hi - lo) / 15).bfloat16().float()
        offset = (lo + 8 * scale).bfloat16().float() - 8 * scale
        safe = torch.where(scale == 0, torch.ones_like(scale), scale)
        q = ((wg - offset[..., None]) / safe[..., None]).round()
    return q.clamp(0, 15).to(torch.uint8).view(rows, cols), scale, offset


def pack_cpu(q: torch.Tensor) -> torch.Tensor:
    """q uint8 [N, K] (N a multiple of 64) → the CPU kernel's layout [N, K / 2]."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)


def unpack_cpu(w: torch.Tensor, n: int, k: int, block: int) -> torch.Tensor:
    """Inverse of pack_cpu with `block` rows per block: [N, K / 2] → q uint8 [N, K] (checked in tests against
    the kernel itself)."""
    w = w.view(n // block, k, block // 2)
    return torch.cat([w & 15, w >> 4], dim=2).transpose(1, 2).reshape(n, k)


def gemv_layout(weight: torch.Tensor, scales_zeros: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's CPU layout → the C++ GEMV's own: scales in unit order [N / 64, K / group, 64, 2] (one stream beside
    the codes'), and 32-row blocks' codes in quads (`quads`)."""
    groups, n = scales_zeros.shape[:2]
    sz = scales_zeros.view(groups, n // 64, 64, 2).transpose(0, 1).contiguous()
    return (quads(weight) if block == 32 else weight), sz


def quads(weight: torch.Tensor) -> torch.Tensor:
    """torch's 32-row blocks [N, K / 2] with each quad of inputs' 64 bytes transposed: a 32-byte half holds 8 rows
    × 4 inputs, VPMADDUBSW's operand as it lies (int4_gemv.cpp)."""
    n, k = weight.shape[0], weight.shape[1] * 2
    return weight.view(n // 32, k // 4, 4, 2, 8).permute(0, 1, 3, 4, 2).reshape(n, k // 2)


def unquads(weight: torch.Tensor) -> torch.Tensor:
    """The inverse of `quads`."""
    n, k = weight.shape[0], weight.shape[1] * 2
    return weight.view(n // 32, k // 4, 2, 8, 4).permute(0, 1, 4, 2, 3).reshape(n, k // 2)


@register("int4")
class Int4Linear(Linear):
    """`gemv_rows` rows or fewer: the C++ GEMV (int4_gemv.py); then `_weight_int4pack_mm_for_cpu` (or the CUDA
    `_weight_int4pack_mm`) up to `max_rows` rows; more rows dequantize to bf16 and run one dense GEMM (the packed
    kernel scales like a loop of GEMVs). `pin_one_kernel` (the batch-invariant factory) keeps one kernel at every
    row count, so a row's numbers do not depend on its batch."""

    gemv_rows = int4_gemv.rows()  # the C++ GEMV up to here: 112 rows with AVX-512 BF16, every step's with AVX2

    # Above this many rows: dequantize (dense_t) + one dense GEMM. Measured on a quiet machine (2 threads, one
    # layer's linears of SmolLM2 / Qwen2.5-0.5B, packed ÷ dequantized time): with the C++ dequantization 0.64-0.80
    # at 32 rows, 0.85-0.96 at 48, 1.01-1.17 at 64, 1.46-1.56 at 128 (bench/RESULTS.md "Speed run 3"); with the
    # torch-op fallback 0.45 at 64, 0.85-0.99 at 192, 0.89-1.16 at 256.
    max_rows: int | None = 56
    max_rows_fallback = 224
    min_rows = 1  # fewer rows are padded up to this many (pin_one_kernel)

    def __init__(self, weight: torch.Tensor, scales_zeros: torch.Tensor, group: int, out_features: int,
                 in_features: int, bias: torch.Tensor | None) -> None:
        self.weight = weight  # packed int4, rows padded to a multiple of 64
        self.block = block_n() or 0  # the CPU layout's rows per block (the weight cache is keyed by capability)
        self.scales_zeros = scales_zeros  # bf16 [K / group, N_padded, 2]; both in the GEMV's layout (set_rows)
        self.group = group
        self.out_features, self.in_features = out_features, in_features
        self.bias = bias
        self.cuda = weight.device.type == "cuda"
        self.widen = not low_precision_gemm_is_fast(weight.device)  # the many-row GEMM in fp32 (see there)
        max_rows = self.max_rows_fallback if not self.cuda and not int4_dequant.available() else self.max_rows
        gemv_rows = 0 if self.cuda or not int4_gemv.available() else self.gemv_rows
        self.set_rows(gemv_rows, max(max_rows, gemv_rows))  # the GEMV, where it runs, also beats the dense path

    def set_rows(self, gemv_rows: int, max_rows: int | None) -> None:
        """Up to `gemv_rows` rows the C++ GEMV, to `max_rows` int4pack, then dequantize + GEMM (None: int4pack at
        every row count, the batch-invariant setting). Where int4pack is never reached, codes and scales lie in the
        GEMV's own layout (`gemv_layout`)."""
        self.gemv_rows, self.max_rows = gemv_rows, max_rows
        w, sz = self.torch_codes(), self.torch_scales()
        if not self.cuda and gemv_rows > 0 and max_rows is not None and max_rows <= gemv_rows:
            w, sz = gemv_layout(w, sz, self.block)
        self.weight, self.scales_zeros = w, sz

    def pin_one_kernel(self) -> None:
        """One row-invariant kernel at every row count (--deterministic): the C++ GEMV where a row's sums do not
        depend on its batch (fewer rows than `int4_gemv.invariant_from` are padded up to it), else int4pack."""
        self.widen = False
        rows = int4_gemv.invariant_from(self.group, self.block) if self.gemv_rows > 0 else None
        if rows is None:
            self.set_rows(self.gemv_rows, None)
            return
        self.min_rows = rows
        self.set_rows(sys.maxsize, sys.maxsize)

    def torch_scales(self) -> torch.Tensor:
        """The scales in torch's order [K / group, N_padded, 2] (a copy where they lie in the GEMV's)."""
        sz = self.scales_zeros
        return sz if sz.dim() == 3 else sz.transpose(0, 1).reshape(sz.shape[1], -1, 2)

    def torch_codes(self) -> torch.Tensor:
        """The codes in torch's CPU layout [N_padded, K / 2] (a copy where they lie in quads)."""
        return unquads(self.weight) if self.scales_zeros.dim() == 4 and self.block == 32 else self.weight

    @classmethod
    def supports(cls, in_features: int, group: int | None) -> bool:
        return in_features % (group or 32) == 0 and block_n() is not None

    @classmethod
    def build(cls, parts: list[Part], bias, dtype, device, group=None) -> Int4Linear:
        group = group or 32
        qs, scales, offsets = zip(*(groups_of(p, group) for p in parts))
        q, scale, offset = torch.cat(qs), torch.cat(scales), torch.cat(offsets)
        n, k = q.shape
        pad = -n % PAD_N
        if pad:
            q = F.pad(q, (0, 0, 0, pad), value=8)
            scale, offset = F.pad(scale, (0, 0, 0, pad)), F.pad(offset, (0, 0, 0, pad))
        sz = torch.stack([scale, offset + 8 * scale], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        if device.type == "cuda":
            tiles = next(t for t in (8, 4, 2, 1) if k % (t * 16) == 0)
            packed = (q[:, ::2] << 4 | q[:, 1::2]).to(device)
            weight = torch.ops.aten._convert_weight_to_int4pack(packed, tiles)
        else:
            weight = pack_cpu(q)
        b = None if bias is None else bias.to(device, torch.float32)
        return cls(weight.to(device), sz.to(device), group, n, k, b)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xb = x.to(torch.bfloat16)
        if self.max_rows is not None and x.shape[0] > self.max_rows and not self.cuda:
            y = x.float() @ self.dense_t().float() if self.widen else xb @ self.dense_t()
        elif self.max_rows is not None and x.shape[0] <= self.gemv_rows:
            m = x.shape[0]
            if m < self.min_rows:  # pinned to rows that sum as in any batch: zero rows make up the rest
                y = torch.ops.tokenhaul_int4.gemv(F.pad(xb, (0, 0, 0, self.min_rows - m)), self.weight,
                                                  self.scales_zeros, self.group, self.block)[:m]
            else:
                y = torch.ops.tokenhaul_int4.gemv(xb, self.weight, self.scales_zeros, self.group, self.block)
        elif self.cuda:
            y = torch.ops.aten._weight_int4pack_mm(xb, self.weight, self.group, self.scales_zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.weight, self.group, self.scales_zeros)
        if y.shape[-1] != self.out_features:
            y = y[..., :self.out_features]
        return self._add_bias(y).to(x.dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the kernel multiplies by, [out, in] (CPU layout only)."""
        sz = self.torch_scales().float()
        n, k = sz.shape[1], self.in_features
        q = unpack_cpu(self.torch_codes(), n, k, self.block).view(n, k // self.group, self.group).float()
        scale, zero = sz[..., 0].t()[..., None], sz[..., 1].t()[..., None]
        w = torch.addcmul(zero - 8 * scale, q, scale).reshape(n, k)
        return w[:self.out_features].to(dtype)

    def dense_t(self) -> torch.Tensor:
        """The weight transposed, [in, out] bf16 (CPU layout): one pass of the C++ kernel (int4_dequant.py),
        or else three passes of torch ops — the codes laid out [in, out] straight from the kernel's blocks, so
        the scales broadcast as stored."""
        if int4_dequant.available():
            return torch.ops.tokenhaul_int4.dequant_t(self.weight, self.scales_zeros, self.group,
                                                      self.block)[:, :self.out_features]
        sz = self.torch_scales()
        n, k, g, b = sz.shape[1], self.in_features, self.group, self.block
        w = self.torch_codes().view(n // b, k, b // 2)
        q = torch.cat([(w & 15).permute(1, 0, 2), (w >> 4).permute(1, 0, 2)], dim=2).view(k // g, g, n)
        sz = sz.view(k // g, 1, n, 2)
        wt = torch.addcmul(sz[..., 1], q.to(torch.bfloat16).sub_(8), sz[..., 0]).view(k, n)
        return wt[:, :self.out_features]

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight, self.scales_zeros] + ([] if self.bias is None else [self.bias])

    def state(self) -> dict[str, torch.Tensor]:
        meta = torch.tensor([self.group, self.out_features, self.in_features])
        return {"weight": self.torch_codes(), "scales_zeros": self.torch_scales(), "meta": meta} | (
            {} if self.bias is None else {"bias": self.bias})

    @classmethod
    def from_state(cls, state, device) -> Int4Linear:
        group, n, k = (int(v) for v in state["meta"])
        bias = state.get("bias")
        return cls(state["weight"].to(device), state["scales_zeros"].to(device), group, n, k,
                   None if bias is None else bias.to(device))
