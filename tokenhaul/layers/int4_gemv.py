"""Int4 packed weights × a few activation rows: `torch.ops.tokenhaul_int4.gemv`, the few-row path of `Int4Linear`
(batch-1 decode), reading the CPU int4pack layout as it is stored (blocks of 64 or 32 rows: `linear_int4.block_n`).

A small C++ kernel (int4_gemv.cpp, built on first use: tokenhaul/native.py), registered as a torch op with a fake
implementation so the compiled decode step can call it. fp32 sums: per group the codes are summed against the
activations and the group's scale and zero applied to the sum — with AVX-512 BF16 (bf16 activations) as bf16
dot products of the codes (exact as bf16) with the activations, else AVX2 FMAs on the codes as fp32.
Without a C++ compiler `Int4Linear` keeps `_weight_int4pack_mm_for_cpu` (one stderr line says so)."""

from __future__ import annotations

from pathlib import Path

import torch

from tokenhaul import native

SOURCE = Path(__file__).with_name("int4_gemv.cpp")


def _fake(x: torch.Tensor, weight: torch.Tensor, scales_zeros: torch.Tensor, group: int, block: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], scales_zeros.shape[1])


def rows() -> int:
    """Up to how many rows the GEMV runs (bench/linear_kernels.py --only gemv, bench/RESULTS.md "int4 GEMV" and
    "Speed run 4"): with AVX-512 BF16 it beats int4pack at every row count (1.2-1.3x at 1-4 rows, 1.5-1.7x at
    8-128) and the dequantize + bf16 GEMM path up to ~120 rows (one layer of SmolLM2 / Qwen: 1.6-2.1x at 32
    rows, 1.07-1.18x at 96, 0.97-1.05x at 128); with AVX2 FMAs only at 1 row (0.55x int4pack at 2). The bf16
    path reads the 64-row blocks torch packs when it runs its AVX-512 kernels."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return 1
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return 112 if {"avx512_bf16", "avx512vbmi", "avx512bw", "avx512vl"} <= set(flags.split()) else 1


def available() -> bool:
    """Build (once per machine, tokenhaul/native.py) and load the kernel; False, with one stderr line, if not."""
    return native.load(SOURCE, "few-row int4 linears run _weight_int4pack_mm_for_cpu instead (slower)",
                       {"tokenhaul_int4::gemv": _fake}, parallel=True)
