"""Paged attention: K/V live in flat cache slots addressed through block tables.

The runner builds one `AttentionMetadata` per step; every layer reads it. Sequences attended
together form an `AttnGroup`: all decodes (one query each) in one padded call, each prefill
chunk in a call of its own, so no query padding is ever computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenhaul.kv import decode_attention
from tokenhaul.kv.int8 import Int8Blocks


@dataclass
class AttnGroup:
    batch: int
    q_len: int
    token_index: torch.Tensor | None  # [batch * q_len] rows of the step's tokens; None = all rows in order
    block_table: torch.Tensor  # [batch, num_blocks] KV blocks of each sequence in order (padding → 0)
    mask: torch.Tensor | None  # [batch, 1, q_len, num_blocks * block_size] True = may attend; None = all
    mask_local: torch.Tensor | None  # the same with the sliding window applied
    block_start: int | None = None  # one sequence whose blocks are consecutive: read them as a view


@dataclass
class AttentionMetadata:
    positions: torch.Tensor  # [T] position of each token of the step
    slot_mapping: torch.Tensor  # [T] flat cache slot where each token's K/V is written
    groups: list[AttnGroup]
    num_tokens: int
    per_query: bool = False  # --deterministic: every query attends alone (see _per_query_sdpa)
    traced: bool = False  # inside the compiled decode graph (engine/compiled_decode.py): see _decode_traced


def _write(cache: torch.Tensor | Int8Blocks, slots: torch.Tensor, x: torch.Tensor) -> None:
    if isinstance(cache, Int8Blocks):
        cache.write(slots, x)
    else:
        nb, bs, Hkv, _ = cache.shape
        cache.view(nb * bs, Hkv, -1)[slots] = x.to(cache.dtype)


def _read(cache: torch.Tensor | Int8Blocks, g: AttnGroup, dtype: torch.dtype) -> torch.Tensor:
    """The group's blocks: a gathered copy, or a view of consecutive blocks; int8 is dequantized here."""
    if isinstance(cache, Int8Blocks):
        if g.block_start is None:
            return cache.gather(g.block_table, dtype)
        return cache.blocks(g.block_start, g.block_start + g.block_table.shape[1], dtype)
    if g.block_start is None:  # gather whole blocks into a contiguous copy (index_select: ~6x faster than [])
        return cache.index_select(0, g.block_table.flatten())
    return cache[g.block_start:g.block_start + g.block_table.shape[1]]  # consecutive blocks: a view, no copy


def _kernel_dtype(kv_dtype: torch.dtype) -> bool:
    return kv_dtype in (torch.int8, torch.bfloat16)


def decodes_in_place(kv_dtype: torch.dtype, device: str = "cpu") -> bool:
    """Whether eager decodes read their K/V blocks in place through kv/decode_attention.py's kernel (int8 and bf16
    caches on the CPU), not SDPA over a gathered copy: what the ledger counts."""
    return _kernel_dtype(kv_dtype) and device == "cpu" and decode_attention.available()


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor | Int8Blocks, v_cache: torch.Tensor | Int8Blocks,
                    meta: AttentionMetadata, scale: float, sliding: bool) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D]; caches: [num_blocks, block_size, Hkv, D].
    Writes the step's K/V into their slots, then gathers whole blocks per sequence. Returns [T, H*D].
    Int8 caches (kv/int8.py) quantize on write; decodes read them with kv/decode_attention.py's kernel (no
    float copy), prefill chunks dequantize the step's blocks on read. Bf16 caches' decodes are read by the same
    kernel (eager and compiled), and under --deterministic their prefill queries too, each as a row of its own;
    fp32 ones (the exact path) go through SDPA (one query a row under --deterministic)."""
    _write(k_cache, meta.slot_mapping, k)
    _write(v_cache, meta.slot_mapping, v)
    T, H, D = q.shape
    out = None if len(meta.groups) == 1 else q.new_empty(T, H * D)
    kv_dtype = torch.int8 if isinstance(k_cache, Int8Blocks) else k_cache.dtype
    # inside the compiled graph the kernel was built before tracing (engine/compiled_decode.py)
    kernel = (meta.traced and q.is_cpu and _kernel_dtype(kv_dtype)) or decodes_in_place(kv_dtype, q.device.type)
    for g in meta.groups:
        qg = q if g.token_index is None else q[g.token_index]
        fold = g.q_len == 1 and not meta.per_query
        mask = g.mask_local if sliding else g.mask
        if kernel and (g.q_len == 1 or meta.per_query):
            # the C++ kernel reads the blocks through the table (int8: scales applied inside): no float copy, and
            # each query's chunks come from its own mask row, so a row's numbers do not depend on its batch.
            # Decodes (eager and compiled), and under --deterministic prefill queries too; inside the compiled
            # graph up to 2.1x inductor's fused reductions (bench/compiled_attention.py); in eager batched steps
            # 1.00-1.52x SDPA over gathered copies (bench/eager_decode_attention.py)
            o = _kernel_rows(qg, g, k_cache, v_cache, mask, scale)
        elif fold and meta.traced:
            o = _decode_traced(qg, k_cache, v_cache, g, mask, scale)
        else:
            o = _sdpa(qg, g, k_cache, v_cache, mask, scale, fold, meta.per_query)
        if out is None:
            return o
        out[g.token_index] = o
    return out


def _sdpa(qg: torch.Tensor, g: AttnGroup, k_cache: torch.Tensor | Int8Blocks, v_cache: torch.Tensor | Int8Blocks,
          mask: torch.Tensor | None, scale: float, fold: bool, per_query: bool) -> torch.Tensor:
    """One group through torch's SDPA over its blocks read as float (a view, a gathered copy, or dequantized)."""
    H, D = qg.shape[1:]
    Hkv = k_cache.shape[2]
    # decodes run in the cache's float dtype: no converted copy of the keys, and the folded bf16 kernel
    # is ~2x faster than fp32 here and gives a row the same bits alone, padded or batched (fp32 does not)
    dt = k_cache.dtype if fold and isinstance(k_cache, torch.Tensor) else qg.dtype
    kg, vg = _read(k_cache, g, dt), _read(v_cache, g, dt)
    kg = kg.reshape(g.batch, -1, Hkv, D).transpose(1, 2).to(dt)  # [B, Hkv, L, D]
    vg = vg.reshape(g.batch, -1, Hkv, D).transpose(1, 2).to(dt)
    if fold:
        # the H // Hkv query heads sharing a KV head become that head's queries — the same numbers,
        # 3-5x faster than a one-query GQA call here (bench/decode_attention.py)
        qf = qg.reshape(g.batch, Hkv, H // Hkv, D).to(dt)
        o = F.scaled_dot_product_attention(qf, kg, vg, attn_mask=mask, scale=scale).reshape(g.batch, H * D)
        o = o.to(qg.dtype)
    else:
        qg = qg.view(g.batch, g.q_len, H, D).transpose(1, 2)
        if per_query:
            o = _per_query_sdpa(qg, kg, vg, mask, scale)
        else:
            o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scale, enable_gqa=True)
        o = o.transpose(1, 2).reshape(g.batch * g.q_len, H * D)
    return o


def _kernel_rows(qg: torch.Tensor, g: AttnGroup, k_cache: torch.Tensor | Int8Blocks,
                 v_cache: torch.Tensor | Int8Blocks, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Attention through the decode kernel: every query, of a decode or (--deterministic) of a prefill chunk, is a
    row of its own with its sequence's table and its own mask row, so its keys split into the
    same chunks, merged in the same order, wherever it is computed. qg: [B * Q, H, D]. Returns [B * Q, H * D]."""
    T, H, D = qg.shape
    Hkv = k_cache.shape[2]
    table = g.block_table if g.q_len == 1 else g.block_table.repeat_interleave(g.q_len, dim=0)
    if mask is not None and g.q_len > 1:  # [B, 1, Q, L] → a row per query [B * Q, 1, 1, L]
        mask = mask.transpose(1, 2).reshape(T, 1, 1, -1)
    o = decode_attention.decode(qg.view(T, Hkv, H // Hkv, D), k_cache, v_cache, table, mask, scale)
    return o.reshape(T, H * D).to(qg.dtype)


def _decode_traced(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: AttnGroup,
                   mask: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per sequence, written as products and sums so that inside a compiled graph (engine/
    compiled_decode.py) inductor fuses the block-table lookup into the reductions: keys are read in place,
    never gathered into a copy. q: [B, H, D]; mask: [B, 1, 1, L]. Returns [B, H*D] (fp32 math)."""
    B, H, D = q.shape
    Hkv = k_cache.shape[2]
    k = k_cache[g.block_table].view(B, -1, Hkv, 1, D).float()  # [B, L, Hkv, 1, D]
    v = v_cache[g.block_table].view(B, -1, Hkv, 1, D).float()
    s = (q.float().view(B, 1, Hkv, H // Hkv, D) * k).sum(-1) * scale  # [B, L, Hkv, G]
    s = s.masked_fill(~mask.view(B, -1, 1, 1), float("-inf"))
    p = s.softmax(dim=1)
    return (p.unsqueeze(-1) * v).sum(1).reshape(B, H * D)


def _per_query_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                    scale: float) -> torch.Tensor:
    """Batch-invariant attention: each query is a one-query row of a single-threaded SDPA call, so a
    token's numbers do not depend on the chunk it was computed in or on what else is batched (the
    multi-threaded kernel splits a lone query's keys across threads; a chunk's kernel tiles queries).
    q: [B, H, Q, D]; k, v: [B, Hkv, L, D]; mask: [B, 1, Q, L] or None. Returns [B, H, Q, D]."""
    B, H, Q, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    if mask is None:
        mask = torch.ones(B, 1, Q, L, dtype=torch.bool, device=q.device)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if Q == 1:  # decodes: one row per sequence already
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out = []
        for b in range(B):  # a chunk's queries become rows sharing its keys (an expanded view, no copy)
            qb = q[b].transpose(0, 1).unsqueeze(2)  # [Q, H, 1, D]
            mb = mask[b].transpose(0, 1).unsqueeze(2)  # [Q, 1, 1, L]
            kb, vb = k[b:b + 1].expand(Q, Hkv, L, D), v[b:b + 1].expand(Q, Hkv, L, D)
            o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mb, scale=scale, enable_gqa=True)
            out.append(o.squeeze(2).transpose(0, 1))  # [H, Q, D]
        return torch.stack(out)
    finally:
        torch.set_num_threads(threads)
