"""Int4 packed weights → dense bf16 W^T in one pass: `torch.ops.tokenhaul_int4.dequant_t`, for the many-row
path of `Int4Linear` (prefill), where the torch-op dequantization took 2 ns a weight (17.8 ms for Qwen's
896 x 9728 gate/up, 17 % of its 2048-row GEMM).

A small C++ kernel (int4_dequant.cpp, built on first use with torch.utils.cpp_extension, cached in
TORCH_EXTENSIONS_DIR), registered as a torch op with a fake implementation so a compiled graph can call it.
Without a C++ compiler `Int4Linear` keeps its torch-op dequantization (one stderr line says so)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("int4_dequant.cpp")
_state: dict[str, bool] = {}


def _flags() -> list[str]:
    """-mavx2 -mfma where torch itself runs its AVX2 kernels: the cached build then runs on this CPU."""
    simd = ["-mavx2", "-mfma"] if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") else []
    return ["-O3", *simd]


def _fake(weight: torch.Tensor, scales_zeros: torch.Tensor, group: int) -> torch.Tensor:
    return scales_zeros.new_empty(scales_zeros.shape[0] * group, scales_zeros.shape[1])


def available() -> bool:
    """Build (once per machine) and load the kernel; False, with one stderr line, if that fails."""
    if "ok" not in _state:
        from torch.utils.cpp_extension import load

        name = "tokenhaul_int4_dequant_" + ("avx2" if "-mavx2" in _flags() else "generic")
        try:
            load(name, [str(SOURCE)], extra_cflags=_flags(), is_python_module=False,
                 verbose=bool(os.environ.get("TOKENHAUL_VERBOSE_BUILD")))
            torch.library.register_fake("tokenhaul_int4::dequant_t", _fake)
            _state["ok"] = True
        except Exception as e:  # no compiler / headers: the torch-op dequantization gives the same values
            print(f"tokenhaul: int4 dequantize kernel not built ({type(e).__name__}: {str(e)[:200]}); "
                  "many-row int4 linears dequantize with torch ops instead (slower)", file=sys.stderr)
            _state["ok"] = False
    return _state["ok"]
