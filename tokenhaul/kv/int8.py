"""Int8Blocks: one layer's K (or V) stored as int8 with a per-token-per-head fp32 scale beside the blocks.

Values are quantized symmetrically on write (scale = max|x| / 127 over the head dimension) and
dequantized only for the blocks a step reads: the cache itself never holds a full-precision copy.

Key caches subtract a per-channel center first (kv/key_centers.py: the mean key of each layer's KV head channels
on a text sample). Attention is unchanged: shifting every key by one vector c moves each query's scores by the
same q·c, which softmax cancels. Qwen2.5's keys carry channels far from zero (a mean of ~145 against an RMS of
~35 in layer 0); with them, one token's scale is set by a channel that carries little of the scores.
"""

from __future__ import annotations

import torch

SCALE_DTYPE = torch.float32


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., D] → (int8 [..., D], scale [...]); per-element error ≤ scale / 2."""
    scale = x.detach().abs().amax(dim=-1).float() / 127.0
    q = (x.float() / scale.clamp_min(1e-30).unsqueeze(-1)).round_().clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Convert first, then scale in place: a mixed int8 × fp32 multiply is ~10x slower here (measured)."""
    return q.to(dtype).mul_(scale.unsqueeze(-1).to(dtype))


class Int8Blocks:
    """[num_blocks, block_size, Hkv, D] int8 values and [num_blocks, block_size, Hkv] scales. `centered`: values
    are stored (and read back) less `center` [Hkv, D], for keys only (zeros until set, set in place)."""

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 device: str | torch.device, alloc=torch.zeros, centered: bool = False) -> None:
        self.data = alloc((num_blocks, block_size, num_kv_heads, head_dim), dtype=torch.int8, device=device)
        self.scale = alloc((num_blocks, block_size, num_kv_heads), dtype=SCALE_DTYPE, device=device)
        self.center = torch.zeros(num_kv_heads, head_dim, dtype=SCALE_DTYPE, device=device) if centered else None

    @staticmethod
    def bytes_per_value(head_dim: int) -> float:
        """Stored bytes per cached value, its share of the head's scale included."""
        return 1 + SCALE_DTYPE.itemsize / head_dim

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    def write(self, slots: torch.Tensor, x: torch.Tensor) -> None:
        """x: [T, Hkv, D] quantized (less the center, if any) into flat cache slots [T]."""
        nb, bs, hkv, d = self.data.shape
        q, s = quantize(x if self.center is None else x.float() - self.center)
        self.data.view(nb * bs, hkv, d)[slots] = q
        self.scale.view(nb * bs, hkv)[slots] = s

    def gather(self, block_table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Blocks of a [batch, n] table, dequantized: [batch, n, block_size, Hkv, D]."""
        idx = block_table.flatten()  # index_select: ~6x faster than [] indexing here (layers/attention.py)
        shape = (*block_table.shape, *self.data.shape[1:])
        data, scale = self.data.index_select(0, idx).view(shape), self.scale.index_select(0, idx).view(shape[:-1])
        return dequantize(data, scale, dtype)

    def blocks(self, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        """Consecutive blocks start..end, dequantized: [end - start, block_size, Hkv, D]."""
        return dequantize(self.data[start:end], self.scale[start:end], dtype)

    def copy_block(self, src: int, dst: int) -> None:
        self.data[dst] = self.data[src]
        self.scale[dst] = self.scale[src]

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scale.nbytes
