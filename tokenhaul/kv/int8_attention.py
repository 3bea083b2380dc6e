"""Decode attention over an int8 KV cache without a float copy of it: `torch.ops.tokenhaul_kv.decode_int8`.

A small C++ kernel (int8_attention.cpp, built on first use with torch.utils.cpp_extension, cached in
TORCH_EXTENSIONS_DIR, ~25 s on 2 cores) reads each sequence's int8 blocks through its block table and
applies the per-token scales to the scores and softmax weights, so no dequantized K/V is ever written.
Registered as a torch op with a fake implementation, so a compiled graph can call it too. Without a C++
compiler the engine falls back to dequantize-then-SDPA (one stderr line says so).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("int8_attention.cpp")
# Blocks of keys per thread task: 32 x 16 keys. Small enough that one 4 k sequence splits into 8 chunks per
# KV head (all threads busy at batch 1), large enough that merging the partial softmaxes costs nothing.
CHUNK_BLOCKS = 32

_state: dict[str, bool] = {}


def _flags() -> list[str]:
    """-mavx2 -mfma where torch itself runs its AVX2 kernels: the cached build then runs on this CPU."""
    simd = ["-mavx2", "-mfma"] if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") else []
    return ["-O3", *simd]


def _fake(q, kd, ks, vd, vs, table, mask, scale, chunk_blocks):  # shapes for torch.compile
    return q.new_empty(q.shape)


def available() -> bool:
    """Build (once per machine) and load the kernel; False, with one stderr line, if that fails."""
    if "ok" not in _state:
        from torch.utils.cpp_extension import load

        name = "tokenhaul_kv_int8_" + ("avx2" if "-mavx2" in _flags() else "generic")
        try:
            load(name, [str(SOURCE)], extra_cflags=_flags(), is_python_module=False,
                 verbose=bool(os.environ.get("TOKENHAUL_VERBOSE_BUILD")))
            torch.library.register_fake("tokenhaul_kv::decode_int8", _fake)
            _state["ok"] = True
        except Exception as e:  # no compiler / headers: the dequantizing path still gives the same answers
            print(f"tokenhaul: int8 KV decode kernel not built ({type(e).__name__}: {str(e)[:200]}); "
                  "int8 KV decodes dequantize a float copy instead (slower)", file=sys.stderr)
            _state["ok"] = False
    return _state["ok"]


def decode_int8(q: torch.Tensor, k_data: torch.Tensor, k_scale: torch.Tensor, v_data: torch.Tensor,
                v_scale: torch.Tensor, block_table: torch.Tensor, mask: torch.Tensor | None,
                scale: float) -> torch.Tensor:
    """q: [B, Hkv, G, D] (the G query heads of each KV head); caches [N, bs, Hkv, D] int8 with scales
    [N, bs, Hkv]; block_table [B, nb]; mask [B, 1, 1, nb * bs] bool or None. Returns fp32 [B, Hkv, G, D]."""
    B, L = block_table.shape[0], block_table.shape[1] * k_data.shape[1]
    m = q.new_empty(0, dtype=torch.bool) if mask is None else mask.reshape(B, L).contiguous()
    return torch.ops.tokenhaul_kv.decode_int8(q.float().contiguous(), k_data, k_scale, v_data, v_scale,
                                              block_table.contiguous(), m, scale, CHUNK_BLOCKS)


