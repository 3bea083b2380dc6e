"""KVCache: the tensor storage behind the block pool — per layer, [num_blocks, block_size, Hkv, D].

Float dtypes store K/V as plain tensors; torch.int8 stores `Int8Blocks` (int8 values + per-token-per-head
scales, kv/int8.py), which layers/attention.py dequantizes only for the blocks a step reads. Int8 keys are
stored less per-layer centers (`set_key_centers`), which leaves attention unchanged."""

from __future__ import annotations

import torch

from tokenhaul.kv.int8 import Int8Blocks

KVLayer = torch.Tensor | Int8Blocks


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: str | torch.device, alloc=torch.zeros) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.dtype = dtype
        shape = (num_blocks, block_size, num_kv_heads, head_dim)

        def make(keys: bool) -> KVLayer:
            if dtype == torch.int8:
                return Int8Blocks(*shape, device, alloc, centered=keys)
            return alloc(shape, dtype=dtype, device=device)

        self.k: list[KVLayer] = [make(True) for _ in range(num_layers)]
        self.v: list[KVLayer] = [make(False) for _ in range(num_layers)]

    @classmethod
    def like(cls, kv: KVCache, alloc=torch.zeros) -> KVCache:
        """A cache of the same shape, dtype and device (`alloc`: torch.zeros or torch.empty)."""
        return cls(len(kv.k), kv.num_blocks, kv.block_size, kv.num_kv_heads, kv.head_dim, kv.dtype, kv.device, alloc)

    @staticmethod
    def bytes_per_value(dtype: torch.dtype, head_dim: int) -> float:
        """Stored bytes per cached K or V value (int8: its share of the scale included)."""
        return Int8Blocks.bytes_per_value(head_dim) if dtype == torch.int8 else dtype.itemsize

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        values = 2 * num_layers * block_size * num_kv_heads * head_dim
        return round(values * KVCache.bytes_per_value(dtype, head_dim))

    def set_key_centers(self, centers: torch.Tensor) -> None:
        """centers: [num_layers, Hkv, D], copied in place into int8 key layers (a compiled step holds them)."""
        if self.dtype != torch.int8:
            return
        if centers.shape != (len(self.k), self.num_kv_heads, self.head_dim):
            raise ValueError(f"key centers of shape {tuple(centers.shape)} for a cache of {len(self.k)} layers, "
                             f"{self.num_kv_heads} KV heads of {self.head_dim}")
        for layer, c in zip(self.k, centers):
            layer.center.copy_(c)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write support: duplicate one block's K/V (and int8 scales) in every layer."""
        for cache in (*self.k, *self.v):
            if isinstance(cache, Int8Blocks):
                cache.copy_block(src, dst)
            else:
                cache[dst] = cache[src]

    @property
    def device(self) -> torch.device:
        return self.k[0].device

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.k, *self.v))
