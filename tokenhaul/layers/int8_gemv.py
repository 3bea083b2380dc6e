"""Few-row int8 linear: `torch.ops.tokenhaul_int8.int8_gemv(x bf16 [M, K], weight int8 [N, K], scales bf16 [N])` → fp32
[M, N], for decode steps of `Int8Linear` (passes of up to 8 rows over the weights). At one row it streams the
SmolLM2 / Qwen lm_heads at 35 GB/s (huge pages, 2 threads) where `_weight_int8pack_mm` read 15 (2.3x); Qwen's int8
layers 1.2-1.4x.
With one row each thread walks its weight rows as 4 runs at once: one sequential run per core left the Sapphire
Rapids host's memory-level parallelism unused (700 MB of Qwen layers: 19 -> 30 GB/s; RESULTS "Speed run 5").

A small C++ kernel (int8_gemv.cpp, built on first use: tokenhaul/native.py), registered as a torch op with a fake
implementation so the compiled decode step can call it. Without a C++ compiler `Int8Linear` keeps the packed
torch kernel (one stderr line says so)."""

from __future__ import annotations

from pathlib import Path

import torch

from tokenhaul import native

SOURCE = Path(__file__).with_name("int8_gemv.cpp")
MAX_ROWS = 8  # rows per pass over the weights (one template per row count)
SHIM = ("AOTITorchError aoti_torch_cpu_int8_gemv(AtenTensorHandle x, AtenTensorHandle weight, "  # the op as a C
        "AtenTensorHandle scales, AtenTensorHandle* out)")  # function (native.c_shims)


def _fake(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32)


def available() -> bool:
    """Build (once per machine, tokenhaul/native.py) and load the kernel; False, with one stderr line, if not."""
    return native.load(SOURCE, "few-row int8 linears run torch's _weight_int8pack_mm instead (slower)",
                       {"tokenhaul_int8::int8_gemv": _fake}, parallel=True,
                       shims={"tokenhaul_int8::int8_gemv": SHIM})
