"""The decode-attention kernel (kv/decode_attention.py), over int8 and bf16 caches, against the same attention
computed in fp32 from the dequantized (or widened) cache, with the queries rounded to int8 where the kernel scores
int8 keys with int8 queries (AVX-512 VNNI): same math, so the stated tolerance is fp32 rounding (1e-5 of max|v|);
and a row's bits do not depend on the batch it is in or the thread count."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tokenhaul.kv import decode_attention
from tokenhaul.kv.int8 import dequantize, quantize


@pytest.fixture(autouse=True)
def _kernel():
    """Built inside a test, not at collection: a build that hangs fails its test (pytest-timeout), not the run."""
    if not decode_attention.available():
        pytest.skip("no C++ compiler for the int8 kernel")


def _cache(n_blocks: int, bs: int, hkv: int, d: int, g: torch.Generator):
    k, v = torch.randn(n_blocks, bs, hkv, d, generator=g) * 2, torch.randn(n_blocks, bs, hkv, d, generator=g)
    (kd, ks), (vd, vs) = quantize(k), quantize(v)
    return kd, ks, vd, vs


LENGTHS, BS, NB = [1, 17, 300, 640], 16, 40  # contexts across the thread-chunk boundary (32 blocks of 16)


def _layout(hkv: int, groups: int, d: int, g: torch.Generator):
    """Shuffled block tables of NB blocks for LENGTHS, queries, and the causal and sliding-window masks."""
    B = len(LENGTHS)
    table = (torch.randperm(B * NB, generator=g) + 1).view(B, NB)
    q = torch.randn(B, hkv, groups, d, generator=g)
    pos = torch.tensor(LENGTHS)[:, None] - 1
    keys = torch.arange(NB * BS)[None, :]
    return table, q, [m.view(B, 1, 1, -1) for m in ((keys <= pos), (keys <= pos) & (keys > pos - 100))]


def _int8_rows(q: torch.Tensor) -> torch.Tensor:
    """q with each row rounded to q8 · max|q| / 127 (to even), as the kernel rounds it for int8 keys."""
    amax = q.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0).div(amax), 0)  # true division, as the kernel
    return torch.round(q * inv) * (amax / 127)


def _dequantized(kd, ks, vd, vs, table) -> tuple[torch.Tensor, torch.Tensor]:
    """The table's blocks of K and V in fp32, [B, Hkv, keys, D]."""
    B, hkv, d = table.shape[0], kd.shape[2], kd.shape[3]
    k = dequantize(kd[table], ks[table]).reshape(B, -1, hkv, d).transpose(1, 2)
    return k, dequantize(vd[table], vs[table]).reshape(B, -1, hkv, d).transpose(1, 2)


def _reference(q, kd, ks, vd, vs, table, mask, scale):
    """Dequantize the table's blocks to fp32 and run torch's SDPA: what the kernel must equal."""
    if decode_attention.int8_queries(kd.shape[1], kd.shape[3]):
        q = _int8_rows(q)
    return F.scaled_dot_product_attention(q.float(), *_dequantized(kd, ks, vd, vs, table), attn_mask=mask,
                                          scale=scale)


@pytest.mark.parametrize("hkv,groups,d", [(3, 3, 64), (2, 7, 64), (1, 4, 256), (2, 2, 40)])
def test_kernel_equals_dequantized_sdpa(hkv, groups, d):
    """Shuffled block tables, contexts across the thread-chunk boundary (32 blocks), causal and
    sliding-window masks, padded rows; head dims with and without the 8-wide path."""
    g = torch.Generator().manual_seed(d + groups)
    kd, ks, vd, vs = _cache(len(LENGTHS) * NB + 1, BS, hkv, d, g)
    table, q, masks = _layout(hkv, groups, d, g)
    for mask in masks:
        out = decode_attention.decode_int8(q, kd, ks, vd, vs, table, mask, d ** -0.5)
        ref = _reference(q, kd, ks, vd, vs, table, mask, d ** -0.5)
        assert out.shape == ref.shape and out.dtype == torch.float32
        assert float((out - ref).abs().max()) < 1e-5 * float(vd.abs().max() * vs.max())
    full = decode_attention.decode_int8(q, kd, ks, vd, vs, table, None, d ** -0.5)
    assert torch.allclose(full, _reference(q, kd, ks, vd, vs, table, None, d ** -0.5), atol=1e-5, rtol=1e-4)


def test_int8_queries_where_vnni():
    """Int8 queries exactly where the kernel's VNNI path takes them: blocks of 16, head dims a multiple of 64, a
    CPU with AVX-512 VNNI; and there the output is off fp32 queries' by about a query rounding step."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    vnni = all(f in flags.split() for f in ("avx512f", "avx512bw", "avx512_vnni"))
    assert decode_attention.int8_queries(16, 64) == vnni == decode_attention.int8_queries(16, 128)
    assert not decode_attention.int8_queries(16, 40) and not decode_attention.int8_queries(8, 64)
    if not vnni:
        pytest.skip("no AVX-512 VNNI: int8 keys are scored in fp32")
    g = torch.Generator().manual_seed(5)
    kd, ks, vd, vs = _cache(len(LENGTHS) * NB + 1, BS, 2, 64, g)
    table, q, masks = _layout(2, 7, 64, g)
    out = decode_attention.decode_int8(q, kd, ks, vd, vs, table, masks[0], 0.125)
    fp32_q = F.scaled_dot_product_attention(q, *_dequantized(kd, ks, vd, vs, table), attn_mask=masks[0], scale=0.125)
    assert 0 < float((out - fp32_q).abs().max()) < 0.05 * float(vd.abs().max() * vs.max())


@pytest.mark.parametrize("hkv,groups,d", [(3, 3, 64), (2, 7, 64), (1, 4, 256), (2, 2, 40)])
def test_bf16_kernel_equals_widened_sdpa(hkv, groups, d):
    """The bf16 cache read by the same kernel: equal to fp32 SDPA over the bf16 values widened, on shuffled
    tables with causal and sliding masks; a row alone equals the row in a padded batch, bit for bit."""
    g = torch.Generator().manual_seed(3 * d + groups)
    B = len(LENGTHS)
    k = (torch.randn(B * NB + 1, BS, hkv, d, generator=g) * 2).bfloat16()
    v = torch.randn(B * NB + 1, BS, hkv, d, generator=g).bfloat16()
    table, q, masks = _layout(hkv, groups, d, g)
    for mask in masks:
        out = decode_attention.decode_bf16(q, k, v, table, mask, d ** -0.5)
        kf = k[table].float().reshape(B, -1, hkv, d).transpose(1, 2)
        vf = v[table].float().reshape(B, -1, hkv, d).transpose(1, 2)
        ref = F.scaled_dot_product_attention(q, kf, vf, attn_mask=mask, scale=d ** -0.5)
        assert out.shape == ref.shape and out.dtype == torch.float32
        assert float((out - ref).abs().max()) < 1e-5 * float(v.float().abs().max())
        own = -(-LENGTHS[2] // BS)
        alone = decode_attention.decode_bf16(q[2:3], k, v, table[2:3, :own], mask[2:3, ..., :own * BS], d ** -0.5)
        assert torch.equal(out[2:3], alone)


def test_row_bits_independent_of_batch_and_threads():
    """Same request at temperature 0 → same numbers whatever else is batched: a row alone (table cut to
    its own blocks), in a padded batch, and on one thread are bit-identical."""
    g = torch.Generator().manual_seed(1)
    bs, nb, hkv, groups, d = 16, 70, 3, 3, 64
    kd, ks, vd, vs = _cache(2 * nb + 1, bs, hkv, d, g)
    table = (torch.randperm(2 * nb, generator=g) + 1).view(2, nb)
    q = torch.randn(2, hkv, groups, d, generator=g)
    lengths = torch.tensor([700, 1100])
    mask = (torch.arange(nb * bs)[None, :] < lengths[:, None]).view(2, 1, 1, -1)
    batched = decode_attention.decode_int8(q, kd, ks, vd, vs, table, mask, 0.125)
    own = -(-700 // bs)
    alone = decode_attention.decode_int8(q[:1], kd, ks, vd, vs, table[:1, :own], mask[:1, ..., :own * bs], 0.125)
    assert torch.equal(batched[:1], alone)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(decode_attention.decode_int8(q, kd, ks, vd, vs, table, mask, 0.125), batched)
    finally:
        torch.set_num_threads(threads)


def test_compiled_graph_can_call_the_kernel():
    """Registered as a torch op with a fake implementation: torch.compile traces through it."""
    g = torch.Generator().manual_seed(2)
    kd, ks, vd, vs = _cache(9, 16, 3, 64, g)
    table = torch.arange(1, 9).view(1, 8)
    q = torch.randn(1, 3, 3, 64, generator=g)

    def step(q):
        return decode_attention.decode_int8(q * 2, kd, ks, vd, vs, table, None, 0.125) + 1

    compiled = torch.compile(step, backend="eager", fullgraph=True)
    assert torch.equal(compiled(q), step(q))


@pytest.mark.parametrize("bs", [4, 12])
def test_blocks_of_a_size_the_8_wide_loops_do_not_divide(bs):
    """Block sizes of 4 and 12 keys (the scalar tails of the kernel's 8-wide loops), int8 and bf16, causal masks
    over unequal lengths: equal to SDPA over the same values in fp32."""
    g = torch.Generator().manual_seed(bs)
    hkv, groups, d, nb, lengths = 2, 3, 64, 30, [1, 5, 45, 119]
    B = len(lengths)
    table = (torch.randperm(B * nb, generator=g) + 1).view(B, nb)
    q = torch.randn(B, hkv, groups, d, generator=g)
    mask = (torch.arange(nb * bs)[None, :] < torch.tensor(lengths)[:, None]).view(B, 1, 1, -1)
    kd, ks, vd, vs = _cache(B * nb + 1, bs, hkv, d, g)
    out = decode_attention.decode_int8(q, kd, ks, vd, vs, table, mask, d ** -0.5)
    ref = _reference(q, kd, ks, vd, vs, table, mask, d ** -0.5)
    assert float((out - ref).abs().max()) < 1e-5 * float(vd.abs().max() * vs.max())
    k, v = (dequantize(kd, ks) * 0.1).bfloat16(), dequantize(vd, vs).bfloat16()
    out = decode_attention.decode_bf16(q, k, v, table, mask, d ** -0.5)
    kf = k[table].float().reshape(B, -1, hkv, d).transpose(1, 2)
    vf = v[table].float().reshape(B, -1, hkv, d).transpose(1, 2)
    ref = F.scaled_dot_product_attention(q, kf, vf, attn_mask=mask, scale=d ** -0.5)
    assert float((out - ref).abs().max()) < 1e-5 * float(v.float().abs().max())
