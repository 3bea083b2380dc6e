"""Few-row bf16 linear: `torch.ops.tokenhaul_bf16.bf16_gemv(x [M, K], weight bf16 [N, K])` → fp32 [M, N], for decode
steps of a bf16 `DenseLinear` (`--quantization none`; passes of up to 8 rows over the weights, fp32 sums). torch's
bf16 `F.linear` read SmolLM2's 121 one-row GEMVs at 11-13 GB/s on an Intel Xeon host (bench/RESULTS.md).

A small C++ kernel (bf16_gemv.cpp, built on first use: tokenhaul/native.py), registered as a torch op with a fake
implementation so the compiled decode step can call it. Without a C++ compiler `DenseLinear` keeps `F.linear`
(one stderr line says so)."""

from __future__ import annotations

from pathlib import Path

import torch

from tokenhaul import native

SOURCE = Path(__file__).with_name("bf16_gemv.cpp")
MAX_ROWS = 8  # rows per pass over the weights (one template per row count)
SHIM = ("AOTITorchError aoti_torch_cpu_bf16_gemv(AtenTensorHandle x, AtenTensorHandle weight, "  # the op as a C
        "AtenTensorHandle* out)")  # function (native.c_shims)


def _fake(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32)


def available() -> bool:
    """Build (once per machine, tokenhaul/native.py) and load the kernel; False, with one stderr line, if not."""
    return native.load(SOURCE, "few-row bf16 linears run torch's F.linear instead (slower)",
                       {"tokenhaul_bf16::bf16_gemv": _fake}, parallel=True,
                       shims={"tokenhaul_bf16::bf16_gemv": SHIM})
