"""Int4 packed weights → dense bf16 W^T in one pass: `torch.ops.tokenhaul_int4.dequant_t`, for the many-row
path of `Int4Linear` (prefill), where the torch-op dequantization took 2 ns a weight (17.8 ms for Qwen's
896 x 9728 gate/up, 17 % of its 2048-row GEMM).

A small C++ kernel (int4_dequant.cpp, built on first use: tokenhaul/native.py), registered as a torch op with a
fake implementation so a compiled graph can call it.
Without a C++ compiler `Int4Linear` keeps its torch-op dequantization (one stderr line says so)."""

from __future__ import annotations

from pathlib import Path

import torch

from tokenhaul import native
from tokenhaul.layers.int4_gemv import outputs

SOURCE = Path(__file__).with_name("int4_dequant.cpp")


def _fake(weight: torch.Tensor, scales_zeros: torch.Tensor, group: int, block: int) -> torch.Tensor:
    groups = scales_zeros.shape[0 if scales_zeros.dim() == 3 else 1]
    return scales_zeros.new_empty(groups * group, outputs(scales_zeros))


def available() -> bool:
    """Build (once per machine, tokenhaul/native.py) and load the kernel; False, with one stderr line, if not."""
    return native.load(SOURCE, "many-row int4 linears dequantize with torch ops instead (slower)",
                       {"tokenhaul_int4::dequant_t": _fake}, parallel=True)
