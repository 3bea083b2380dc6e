"""Decode attention over an int8 KV cache without a float copy of it: `torch.ops.tokenhaul_kv.decode_int8`.

A small C++ kernel (int8_attention.cpp, built on first use: tokenhaul/native.py) reads each sequence's int8
blocks through its block table and applies the per-token scales to the scores and softmax weights, so no
dequantized K/V is ever written.
A torch op with a fake implementation, so a compiled graph can call it too. Without a C++ compiler the
engine falls back to dequantize-then-SDPA (one stderr line says so).
"""

from __future__ import annotations

from pathlib import Path

import torch

from tokenhaul import native

SOURCE = Path(__file__).with_name("int8_attention.cpp")
# Blocks of keys per thread task: 32 x 16 keys. Small enough that one 4 k sequence splits into 8 chunks per
# KV head (all threads busy at batch 1), large enough that merging the partial softmaxes costs nothing.
CHUNK_BLOCKS = 32


def _fake(q, kd, ks, vd, vs, table, mask, scale, chunk_blocks):  # shapes for torch.compile
    return q.new_empty(q.shape)


def available() -> bool:
    """Build (once per machine) and load the kernel; False, with one stderr line, if that fails."""
    return native.load(SOURCE, "int8 KV decodes dequantize a float copy instead (slower)",
                       {"tokenhaul_kv::decode_int8": _fake}, parallel=True)


def decode_int8(q: torch.Tensor, k_data: torch.Tensor, k_scale: torch.Tensor, v_data: torch.Tensor,
                v_scale: torch.Tensor, block_table: torch.Tensor, mask: torch.Tensor | None,
                scale: float) -> torch.Tensor:
    """q: [B, Hkv, G, D] (the G query heads of each KV head); caches [N, bs, Hkv, D] int8 with scales
    [N, bs, Hkv]; block_table [B, nb]; mask [B, 1, 1, nb * bs] bool or None. Returns fp32 [B, Hkv, G, D]."""
    B, L = block_table.shape[0], block_table.shape[1] * k_data.shape[1]
    m = q.new_empty(0, dtype=torch.bool) if mask is None else mask.reshape(B, L).contiguous()
    return torch.ops.tokenhaul_kv.decode_int8(q.float().contiguous(), k_data, k_scale, v_data, v_scale,
                                              block_table.contiguous(), m, scale, CHUNK_BLOCKS)


