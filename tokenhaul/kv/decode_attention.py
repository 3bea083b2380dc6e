"""Decode attention over a paged KV cache without a copy of it: `torch.ops.tokenhaul_kv.decode_int8` (int8
blocks with per-token scales) and `decode_bf16`.

A small C++ kernel (decode_attention.cpp, built on first use: tokenhaul/native.py) reads each sequence's blocks
through its block table and converts them in L1 (int8: the per-token scales applied to the scores and softmax
weights), so no gathered or dequantized K/V is ever written. Int8 keys on a CPU with AVX-512 VNNI are scored
with int8 queries instead (`int8_queries`).
Torch ops with fake implementations, so a compiled graph can call them too. Without a C++ compiler the engine
falls back to gather-then-SDPA (one stderr line says so).
"""

from __future__ import annotations

from pathlib import Path

import torch

from tokenhaul import native
from tokenhaul.kv.int8 import Int8Blocks

SOURCE = Path(__file__).with_name("decode_attention.cpp")
# Fewest blocks of keys per thread task (a sequence's visible blocks are cut in at most 16 chunks per KV head,
# decode_attention.cpp): 2 x 16 keys, so a lone short sequence still splits into about equal tasks for every
# thread, while merging the partial softmaxes stays negligible.
MIN_CHUNK_BLOCKS = 2


_TENSORS = "AtenTensorHandle q, AtenTensorHandle kd, "
SHIMS = {  # the ops as C functions (native.c_shims)
    "tokenhaul_kv::decode_int8": f"AOTITorchError aoti_torch_cpu_decode_int8({_TENSORS}AtenTensorHandle ks, "
    "AtenTensorHandle vd, AtenTensorHandle vs, AtenTensorHandle table, AtenTensorHandle mask, double scale, "
    "int64_t min_chunk_blocks, AtenTensorHandle* out)",
    "tokenhaul_kv::decode_bf16": f"AOTITorchError aoti_torch_cpu_decode_bf16({_TENSORS}AtenTensorHandle vd, "
    "AtenTensorHandle table, AtenTensorHandle mask, double scale, int64_t min_chunk_blocks, AtenTensorHandle* out)",
}


def _fake_int8(q, kd, ks, vd, vs, table, mask, scale, min_chunk_blocks):  # shapes for torch.compile
    return q.new_empty(q.shape)


def _fake_bf16(q, kd, vd, table, mask, scale, min_chunk_blocks):
    return q.new_empty(q.shape)


def available() -> bool:
    """Build (once per machine) and load the kernel; False, with one stderr line, if that fails."""
    return native.load(SOURCE, "decodes gather a float copy of their K/V instead (slower)",
                       {"tokenhaul_kv::decode_int8": _fake_int8, "tokenhaul_kv::decode_bf16": _fake_bf16},
                       parallel=True, shims=SHIMS)


def int8_queries(block_size: int, head_dim: int) -> bool:
    """Whether int8 caches of this shape score their keys with int8 queries (AVX-512 VNNI, blocks of 16, head dims
    a multiple of 64: each query row rounded to q8 · max|q| / 127, to even, as llama.cpp rounds its Q for quantized
    K); else in fp32."""
    return available() and torch.ops.tokenhaul_kv.int8_queries(block_size, head_dim)


def _args(q: torch.Tensor, block_table: torch.Tensor, mask: torch.Tensor | None,
          block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, L = block_table.shape[0], block_table.shape[1] * block_size
    m = q.new_empty(0, dtype=torch.bool) if mask is None else mask.reshape(B, L).contiguous()
    return q.float().contiguous(), block_table.contiguous(), m


def decode_int8(q: torch.Tensor, k_data: torch.Tensor, k_scale: torch.Tensor, v_data: torch.Tensor,
                v_scale: torch.Tensor, block_table: torch.Tensor, mask: torch.Tensor | None,
                scale: float) -> torch.Tensor:
    """q: [B, Hkv, G, D] (the G query heads of each KV head); caches [N, bs, Hkv, D] int8 with scales
    [N, bs, Hkv]; block_table [B, nb]; mask [B, 1, 1, nb * bs] bool or None. Returns fp32 [B, Hkv, G, D]."""
    qf, table, m = _args(q, block_table, mask, k_data.shape[1])
    return torch.ops.tokenhaul_kv.decode_int8(qf, k_data, k_scale, v_data, v_scale, table, m, scale, MIN_CHUNK_BLOCKS)


def decode_bf16(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """decode_int8 over bf16 caches [N, bs, Hkv, D] (no scales)."""
    qf, table, m = _args(q, block_table, mask, k_cache.shape[1])
    return torch.ops.tokenhaul_kv.decode_bf16(qf, k_cache, v_cache, table, m, scale, MIN_CHUNK_BLOCKS)


def decode(q: torch.Tensor, k_cache: torch.Tensor | Int8Blocks, v_cache: torch.Tensor | Int8Blocks,
           block_table: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """decode_int8 or decode_bf16, by the caches' storage."""
    if isinstance(k_cache, Int8Blocks):
        return decode_int8(q, k_cache.data, k_cache.scale, v_cache.data, v_cache.scale, block_table, mask, scale)
    return decode_bf16(q, k_cache, v_cache, block_table, mask, scale)
