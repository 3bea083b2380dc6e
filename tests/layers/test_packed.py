"""Packed weights: GGUF 4-bit blocks map onto the int4 kernel without loss beyond bf16 scales, each kernel
matches a float reference on random shapes, the registry's choices and errors, and the on-disk cache."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tiny_models import tiny_model

from tokenhaul.errors import TokenhaulError
from tokenhaul.layers import int8_gemv
from tokenhaul.layers.gguf_weight import GGUFWeight
from tokenhaul.layers.linear_int4 import (
    Int4Linear,
    block_n,
    gemv_layout,
    groups_of,
    pack_cpu,
    quads,
    unpack_cpu,
    unquads,
)
from tokenhaul.layers.linear_int8 import Int8Linear
from tokenhaul.layers.linear_sparse import sparsify
from tokenhaul.layers.quantization import LinearFactory, QuantSpec

CPU = torch.device("cpu")


def gguf_weight(qtype: Q, rows: int, cols: int, seed: int = 0) -> GGUFWeight:
    """Random weights in GGUF blocks: quantized by gguf itself where it can, else random block bytes with
    small finite fp16 scales (every byte pattern of the quants is a valid block)."""
    rng = np.random.default_rng(seed)
    if qtype in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0):
        data = quantize(rng.standard_normal((rows, cols), dtype=np.float32) * 0.1, qtype)
        return GGUFWeight(qtype, (rows, cols), data.reshape(rows, -1))
    block, size = GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    d = (rng.random((data.shape[0], 2)) * 0.01).astype(np.float16).view(np.uint8)
    if qtype == Q.Q4_K:
        data[:, 0:4] = d
    else:  # Q2_K / Q6_K keep d (and dmin) at the end of the block
        data[:, -4:] = d
    return GGUFWeight(qtype, (rows, cols), data.reshape(rows, -1))


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K])
def test_int4_blocks_equal_gguf_dequantize(qtype):
    w = gguf_weight(qtype, 96, 512)
    ref = torch.from_numpy(dequantize(w.data, qtype).reshape(96, 512))
    q, scale, offset = groups_of(w, 32)
    exact = (q.view(96, 16, 32).float() * scale[..., None] + offset[..., None]).view(96, 512)
    torch.testing.assert_close(exact, ref, rtol=1e-6, atol=1e-7)  # the 4-bit codes are the file's own
    lin = Int4Linear.build([w], None, torch.bfloat16, CPU, 32)
    assert torch.equal(unpack_cpu(lin.torch_codes(), 128, 512, block_n())[:96], q)
    # the kernel itself, fed the identity, returns W^T: only bf16 scales/zeros (and bf16 output) differ
    eye = torch.eye(512, dtype=torch.bfloat16)
    kernel_w = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, lin.torch_codes(), 32, lin.torch_scales()).float().t()
    tol = ref.abs().amax(dim=1, keepdim=True) * 2 ** -7
    assert ((kernel_w[:96] - ref).abs() <= tol).all()
    assert ((lin.dequantize() - ref).abs() <= tol).all()


@pytest.mark.parametrize("n,k,group", [(64, 32, 32), (200, 384, 64), (576, 896, 128)])
def test_cpp_dequantize_equals_torch_ops(monkeypatch, n, k, group):
    """The one-pass C++ dequantization (int4_dequant.cpp) writes the same bf16 values as the torch-op path."""
    from tokenhaul.layers import int4_dequant

    assert int4_dequant.available()
    lin = Int4Linear.build([torch.randn(n, k)], None, torch.bfloat16, CPU, group)
    fast = lin.dense_t()
    monkeypatch.setattr(int4_dequant, "available", lambda: False)
    assert fast.shape == (k, n) and torch.equal(fast, lin.dense_t())


def pack_blocks(q: torch.Tensor, block: int) -> torch.Tensor:
    """torch's CPU int4pack layout with `block` rows per block, written out: [N, K] codes → [N, K / 2] bytes."""
    n, k = q.shape
    b = q.view(n // block, 2, block // 2, k).permute(0, 3, 1, 2)  # [N / block, K, low / high half, block / 2]
    return (b[:, :, 0] | b[:, :, 1] << 4).reshape(n, k // 2).contiguous()


def test_pack_layout_round_trip():
    """The layout torch packs on this CPU is the one tokenhaul reads (64-row blocks with AVX-512, 32 with AVX2)."""
    q = torch.randint(0, 16, (192, 96), dtype=torch.uint8)
    assert block_n() in (32, 64)
    assert torch.equal(pack_cpu(q), pack_blocks(q, block_n()))
    for block in (32, 64):
        assert torch.equal(unpack_cpu(pack_blocks(q, block), 192, 96, block), q)
    packed = pack_blocks(q, 32)  # the GEMV's quads: byte 32 h + 4 r + i of quad t = rows 8 h + r | 16 + 8 h + r
    quad = quads(packed).view(192 // 32, 96 // 4, 64)  # at input 4 t + i
    for blk, t, h, r, i in ((0, 0, 0, 0, 0), (1, 3, 1, 5, 2), (5, 23, 1, 7, 3), (2, 10, 0, 3, 1)):
        row, col = 32 * blk + 8 * h + r, 4 * t + i
        assert quad[blk, t, 32 * h + 4 * r + i] == q[row, col] | q[row + 16, col] << 4
    assert torch.equal(unquads(quads(packed)), packed)


@pytest.mark.parametrize("block", [32, 64])
def test_kernels_read_both_layouts(block):
    """The C++ GEMV and dequantization read either block size, whichever one torch uses on this CPU (the
    other is written out by hand): same values as the codes they were packed from."""
    from tokenhaul.layers import int4_dequant, int4_gemv

    assert int4_gemv.available() and int4_dequant.available()
    g = torch.Generator().manual_seed(block)
    n, k, group = 192, 256, 32
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    sz = (torch.randn(k // group, n, 2, generator=g) * 0.1).bfloat16()
    scale, zero = sz[..., 0].float().t(), sz[..., 1].float().t()  # [n, groups]
    w = ((q.float() - 8).view(n, -1, group) * scale[..., None] + zero[..., None]).view(n, k)
    packed = pack_blocks(q, block)
    own = gemv_layout(packed, sz, block)  # scales in unit order; 32-row blocks' codes in quads
    for codes, scales in ((packed, sz), own):
        dense = torch.ops.tokenhaul_int4.dequant_t(codes, scales, group, block)
        assert torch.equal(dense.float(), w.bfloat16().float().t())
    x = torch.randn(3, k, generator=g)
    if block == 32:
        with pytest.raises(RuntimeError, match="the GEMV's layout"):
            torch.ops.tokenhaul_int4.gemv(x, packed, sz, group, block)
    for rows in (x[:1], x):
        y = torch.ops.tokenhaul_int4.gemv(rows, *own, group, block).double()
        ref = rows.double() @ w.double().t()
        assert ((y - ref).abs() <= 1e-4 * (rows.double().abs() @ w.double().abs().t()) + 1e-6).all()
    for rows in (x[:1], x[:2], x):  # bf16 activations: the 8-bit path (1-2 rows, where it runs) reads both too
        xb = rows.bfloat16()
        y = torch.ops.tokenhaul_int4.gemv(xb, *own, group, block).double()
        eight = int4_gemv.eight_bit_activations(len(rows), group, block)
        ref = (int4_gemv.quantize_activations(xb) if eight else xb).double() @ w.double().t()
        assert ((y - ref).abs() <= 2 ** -8 * ref.abs() + 1e-4 * (xb.double().abs() @ w.double().abs().t())).all()


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 200), k_groups=st.integers(1, 6), m=st.integers(1, 40), group=st.sampled_from([32, 64, 128]),
       bias=st.booleans(), seed=st.integers(0, 2**16))
def test_int4_kernel_matches_float_reference(n, k_groups, m, group, bias, seed):
    """Requantized weights: |w - dequant| <= scale / 2 per group; the kernel equals bf16 x @ dequant^T
    within 1 % of sum |x_i w_i| (bf16 activations, weights and output: rounding scales with the terms summed,
    not with a result that cancellation may have made small)."""
    g = torch.Generator().manual_seed(seed)
    k = group * k_groups
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    lin = Int4Linear.build([w], b, torch.bfloat16, CPU, group)
    deq = lin.dequantize()
    wg = w.view(n, k_groups, group)
    step = (wg.amax(-1) - wg.amin(-1)) / 15
    slack = wg.abs().amax(-1) * 2 ** -7  # bf16 rounding of scale and zero
    assert ((w - deq).view(n, k_groups, group).abs() <= (step * 0.51 + slack)[..., None]).all()
    x = torch.randn(m, k, generator=g)
    ref = x.bfloat16().float() @ deq.t() + (0 if b is None else b)
    y = lin(x)
    assert y.shape == (m, n) and y.dtype == torch.float32
    tol = 0.01 * (x.bfloat16().float().abs() @ deq.abs().t()) + 1e-3
    assert ((y - ref).abs() <= tol).all()
    assert torch.equal(lin.dense_t().t(), deq.bfloat16())  # the fast dequantization rounds once, like the reference
    lin.max_rows = 0  # the dense path for many rows computes the same product
    assert ((lin(x) - ref).abs() <= tol).all()


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 300), k_groups=st.integers(1, 9), m=st.integers(1, 9), group=st.sampled_from([32, 64, 128]),
       threads=st.sampled_from([1, 2, 3]), seed=st.integers(0, 2**16))
@example(n=300, k_groups=9, m=2, group=32, threads=2, seed=7)  # the 8-bit path's pair of rows, every run
@example(n=130, k_groups=3, m=1, group=128, threads=1, seed=8)
def test_int4_gemv_matches_float_reference(n, k_groups, m, group, threads, seed):
    check_int4_gemv(n, k_groups, m, group, threads, seed)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("m", [1, 5])
def test_int4_gemv_large_weight_cut_in_parts(m, threads):
    """A weight of over 1 MB of codes (RANGES_FROM in int4_gemv.cpp) takes the path where each thread walks its
    share as parts: the same accuracy and the same row-alone = row-in-batch results as small ones."""
    check_int4_gemv(2112, 16, m, 64, threads, seed=m * 10 + threads)


def check_int4_gemv(n: int, k_groups: int, m: int, group: int, threads: int, seed: int) -> None:
    """The C++ GEMV (int4_gemv.cpp) against x @ dequant^T in fp64: with fp32 activations and output,
    |error| <= 1e-4 * sum |x_i w_i| — fp32 rounding of per-group sums of codes, the low nibbles' sum taken as a
    difference of sums of bytes up to 255 (worst seen 1.3e-5); with bf16 activations and output, bf16 rounding
    (2^-8 relative) on top (bf16 activations of one or two rows are quantized to 8 bits per 16 inputs, summed by
    VNNI or AVX2, and so are more rows with AVX-512 VNNI: exact against those values, and within half a step per
    input of the bf16 ones; else more rows take the bf16 dot-product path on a CPU with AVX-512 BF16; fp32
    activations the AVX2 path). Each row's result is the same whatever rows share the call (bf16: whatever rows
    of the same path, AVX2's panels apart: test_int4_gemv_panels_give_a_row_the_same_bits_in_any_batch) at one
    thread count: the thread count moves where a block's groups are split between
    threads, and so the fp32 rounding of that block's sum (rows compared at another thread count than the batch
    failed 1 in ~170 cases on a Zen 5 host)."""
    from tokenhaul.layers import int4_gemv

    assert int4_gemv.available()
    g = torch.Generator().manual_seed(seed)
    k = group * k_groups
    lin = Int4Linear.build([torch.randn(n, k, generator=g)], None, torch.bfloat16, CPU, group)
    deq = lin.dequantize()
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y32 = torch.ops.tokenhaul_int4.gemv(x, lin.weight, lin.scales_zeros, group, lin.block)[:, :n]
        y16 = torch.ops.tokenhaul_int4.gemv(x.bfloat16(), lin.weight, lin.scales_zeros, group,
                                           lin.block)[:, :n]
        rows = [torch.ops.tokenhaul_int4.gemv(x[i:i + 1], lin.weight, lin.scales_zeros, group, lin.block)[:, :n]
                for i in range(m)]
        rows16 = [torch.ops.tokenhaul_int4.gemv(x[i:i + 1].bfloat16(), lin.weight, lin.scales_zeros, group,
                                                lin.block) for i in range(m)]
    finally:
        torch.set_num_threads(before)
    assert y32.dtype == torch.float32 and y16.dtype == torch.bfloat16 and y32.shape == (m, n)
    deq = deq.double()
    terms = x.double().abs() @ deq.abs().t()
    assert ((y32.double() - x.double() @ deq.t()).abs() <= 1e-4 * terms).all()
    ref16 = x.bfloat16().double() @ deq.t()
    if int4_gemv.eight_bit_activations(m, group, lin.block):  # the 8-bit x: to fp32 rounding of that product,
        xq = int4_gemv.quantize_activations(x.bfloat16()).double()
        exact = xq @ deq.t()
        assert ((y16.double() - exact).abs() <= 2 ** -8 * exact.abs() + 1e-4 * terms).all()
        # and the rounding of x itself: each input off by at most half its block's step (max |x| / 254)
        step = x.bfloat16().double().view(m, -1, int4_gemv.QBLOCK).abs().amax(-1, keepdim=True) / 254
        slack = step.expand(m, k // int4_gemv.QBLOCK, int4_gemv.QBLOCK).reshape(m, k) @ deq.abs().t()
        assert ((xq - x.bfloat16().double()).abs().view(m, -1, int4_gemv.QBLOCK) <= step * 1.0001).all()
        assert ((y16.double() - ref16).abs() <= 2 ** -8 * exact.abs() + 1e-4 * terms + slack).all()
    else:
        assert ((y16.double() - ref16).abs() <= 2 ** -8 * ref16.abs() + 1e-4 * terms).all()
    assert torch.equal(torch.cat(rows), y32)
    one_way = m <= 2 or lin.block == 64  # AVX2's panels (3 or more rows) sum otherwise than a row alone
    if one_way and int4_gemv.eight_bit_activations(1, group, lin.block) == int4_gemv.eight_bit_activations(
            m, group, lin.block):
        assert torch.equal(torch.cat(rows16)[:, :n], y16)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_gemv_many_rows_in_tiles_as_if_each_row_were_alone(group):
    """With AVX-512 VNNI, 3 or more bf16 rows take the 8-bit path in tiles of 8 rows (int4_gemv.cpp
    unit_tiles_i8): each row's output equals, to the bit, that row sent alone (1-2 rows: block_rows_vnni), for
    row counts that fill whole tiles and leave remainders, and equals the 8-bit x times the weight to fp32
    rounding. Elsewhere the many-row path is AVX2's 8-bit panels
    (test_int4_gemv_panels_give_a_row_the_same_bits_in_any_batch), the bf16 or the fp32 one
    (test_int4_kernel_matches_float_reference)."""
    from tokenhaul.layers import int4_gemv

    if block_n() != 64 or not int4_gemv.eight_bit_activations(3, group, 64):
        pytest.skip("no AVX-512 VNNI here: 3 or more rows take the panels, the bf16 or the fp32 path")
    g = torch.Generator().manual_seed(group)
    n, k = 320, group * 5
    lin = Int4Linear.build([torch.randn(n, k, generator=g)], None, torch.bfloat16, CPU, group)
    deq = lin.dequantize().double()
    x = (torch.randn(41, k, generator=g) * torch.rand(41, 1, generator=g) * 4).bfloat16()
    alone = torch.cat([torch.ops.tokenhaul_int4.gemv(x[i:i + 1], lin.weight, lin.scales_zeros, group, lin.block)
                       for i in range(len(x))])
    for m in (3, 8, 11, 16, 41):
        y = torch.ops.tokenhaul_int4.gemv(x[:m], lin.weight, lin.scales_zeros, group, lin.block)
        assert torch.equal(y, alone[:m]), m
    exact = int4_gemv.quantize_activations(x).double() @ deq.t()
    terms = x.double().abs() @ deq.abs().t()
    assert ((alone.double() - exact).abs() <= 2 ** -8 * exact.abs() + 1e-4 * terms).all()


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_gemv_panels_give_a_row_the_same_bits_in_any_batch(group):
    """With 32-row blocks (AVX2 hosts) bf16 rows of 3 or more take the 8-bit x against panels of codes laid out in
    L1, in 2-row tiles (int4_gemv.cpp panel_blocks_i8): a row's output is the same, to the bit, wherever it sits in
    a batch of 3 or more rows and at any thread count (tile remainders, x cut in chunks of 192 rows, K in chunks of
    128 inputs), and equals the 8-bit x times the weight to fp32 rounding and the output's bf16 rounding."""
    from tokenhaul.layers import int4_gemv

    if not int4_gemv.eight_bit_activations(3, group, 32):
        pytest.skip("the 8-bit panels need the AVX2 build")
    g = torch.Generator().manual_seed(group)
    n, k = 100, group * 5
    q = torch.randint(0, 16, (128, k), dtype=torch.uint8, generator=g)
    sz = (torch.randn(k // group, 128, 2, generator=g) * 0.1).bfloat16()
    scale, zero = sz[..., 0].double().t(), sz[..., 1].double().t()
    deq = ((q.double() - 8).view(128, -1, group) * scale[..., None] + zero[..., None]).view(128, k)[:n]
    packed, sz = gemv_layout(pack_blocks(q, 32), sz, 32)
    x = (torch.randn(203, k, generator=g) * torch.rand(203, 1, generator=g) * 4).bfloat16()
    gemv = torch.ops.tokenhaul_int4.gemv
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        full = gemv(x, packed, sz, group, 32)[:, :n]
        for threads, start, m in ((1, 0, 3), (3, 5, 13), (2, 190, 13), (1, 7, 196)):
            torch.set_num_threads(threads)
            assert torch.equal(gemv(x[start:start + m], packed, sz, group, 32)[:, :n], full[start:start + m])
    finally:
        torch.set_num_threads(before)
    exact = int4_gemv.quantize_activations(x).double() @ deq.t()
    terms = x.double().abs() @ deq.abs().t()
    assert ((full.double() - exact).abs() <= 2 ** -8 * exact.abs() + 1e-4 * terms).all()


def test_int4_linear_takes_the_gemv_at_few_rows(monkeypatch):
    """Calls of up to `gemv_rows` rows go through the C++ GEMV, more rows through int4pack; the batch-invariant
    setting (max_rows None) keeps int4pack at every row count."""
    lin = Int4Linear.build([torch.randn(96, 128)], None, torch.bfloat16, CPU, 32)
    assert lin.gemv_rows >= 1
    calls = []
    gemv = torch.ops.tokenhaul_int4.gemv
    monkeypatch.setattr(torch.ops.tokenhaul_int4, "gemv", lambda *a: calls.append(a[0].shape[0]) or gemv(*a))
    x = torch.randn(lin.gemv_rows + 1, 128)
    lin(x[:1]), lin(x[:-1]), lin(x)
    assert calls == [1, lin.gemv_rows]
    lin.set_rows(lin.gemv_rows, None)
    lin(x[:1])
    assert calls == [1, lin.gemv_rows]


def test_int4_scales_in_unit_order_change_no_bit():
    """Where every packed call runs the GEMV, codes and scales lie in its own layout (scales in unit order
    [N / 64, K / group, 64, 2], 32-row blocks' codes in quads): the GEMV gives the same bits as from torch's
    order where it reads both (64-row blocks), the dequantization does everywhere, int4pack gets torch's
    layout back when it is reached, and the weight cache keeps torch's layout."""
    lin = Int4Linear.build([torch.randn(200, 256)], None, torch.bfloat16, CPU, 32)
    assert lin.scales_zeros.dim() == 4 and lin.scales_zeros.shape == (256 // 64, 256 // 32, 64, 2)
    torch_order, torch_codes = lin.torch_scales(), lin.torch_codes()
    assert torch_order.shape == (256 // 32, 256, 2)
    if lin.block == 64:
        assert torch.equal(lin.weight, torch_codes)
        for m in (1, 2, 5):
            for x in (torch.randn(m, 256), torch.randn(m, 256).bfloat16()):
                assert torch.equal(torch.ops.tokenhaul_int4.gemv(x, lin.weight, lin.scales_zeros, 32, lin.block),
                                   torch.ops.tokenhaul_int4.gemv(x, lin.weight, torch_order, 32, lin.block))
    else:
        assert torch.equal(lin.weight, quads(torch_codes))
    assert torch.equal(torch.ops.tokenhaul_int4.dequant_t(lin.weight, lin.scales_zeros, 32, lin.block),
                       torch.ops.tokenhaul_int4.dequant_t(torch_codes, torch_order, 32, lin.block))
    assert torch.equal(lin.state()["scales_zeros"], torch_order) and torch.equal(lin.state()["weight"], torch_codes)
    again = Int4Linear.from_state(lin.state(), CPU)
    assert torch.equal(again.scales_zeros, lin.scales_zeros) and torch.equal(again.weight, lin.weight)
    x = torch.randn(3, 256).bfloat16()
    y = lin(x)
    lin.set_rows(1, 56)  # int4pack from 2 rows (AVX-512 hosts without BF16): torch's layout
    assert lin.scales_zeros.dim() == 3 and torch.equal(lin.scales_zeros, torch_order)
    assert torch.equal(lin.weight, torch_codes)
    pack = torch.ops.aten._weight_int4pack_mm_for_cpu(x, lin.weight, 32, lin.scales_zeros)[:, :200]
    assert (lin(x).float() - pack.float()).abs().max() == 0
    assert (y.float() - pack.float()).abs().max() <= 0.02 * pack.float().abs().max()


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 200), k16=st.integers(1, 18), m=st.integers(1, 40), bias=st.booleans(),
       seed=st.integers(0, 2**16))
def test_int8_kernels_match_float_reference(n, k16, m, bias, seed):
    """Both int8 paths against fp32 x @ dequant^T (+ b): the packed kernel (bf16 activations and output) within
    1 %; the integer GEMM within the rounding of its 16-bit activations, |error| <= s / 508 * sum |w| per
    output (s = max |x| / 127 of the row), plus fp32 rounding."""
    g = torch.Generator().manual_seed(seed)
    k = 16 * k16
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    lin = Int8Linear.build([w], b, torch.bfloat16, CPU)
    deq = lin.dequantize()
    assert ((w - deq).abs() <= w.abs().amax(1, keepdim=True) / 126 * 0.51 + 1e-6).all()
    x = torch.randn(m, k, generator=g)
    ref = x @ deq.t() + (0 if b is None else b)
    lin.packed_rows, lin.gemv = m, False  # the packed kernel
    xb = x.bfloat16().float()
    tol = 0.01 * (xb.abs() @ deq.abs().t()) + 1e-3
    assert ((lin(x) - (xb @ deq.t() + (0 if b is None else b))).abs() <= tol).all()
    lin.packed_rows = 0  # the integer GEMM
    y = lin(x)
    assert y.shape == (m, n) and y.dtype == torch.float32
    row_scale = x.abs().amax(1, keepdim=True) / 127
    assert ((y - ref).abs() <= row_scale / 508 * deq.abs().sum(1) * 1.001 + 1e-4 * (x.abs() @ deq.abs().t())).all()


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 300), k=st.integers(1, 5000), m=st.integers(1, 20), bias=st.booleans(),
       seed=st.integers(0, 2**16))
def test_int8_gemv_matches_float_reference(n, k, m, bias, seed):
    """The C++ few-row kernel against fp32 x @ dequant^T (+ b), for any width (SIMD body and scalar tail, int32
    flushes past 4096 inputs): within the rounding of its 16-bit activations, |error| <= s / 2 * sum |w| per
    output (s = max |x| / 32767 of the row), plus fp32 rounding."""
    if not int8_gemv.available():
        pytest.skip("no C++ compiler")
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    lin = Int8Linear(*_int8_parts(w), None if b is None else b.float())
    deq = lin.dequantize()
    x = torch.randn(m, k, generator=g).bfloat16()
    ref = x.float() @ deq.t() + (0 if b is None else b)
    lin.gemv_rows = lambda m: True
    y = lin(x).float()
    row_scale = x.float().abs().amax(1, keepdim=True) / 32767
    bound = row_scale / 2 * deq.abs().sum(1) * 1.001 + 1e-5 * (x.float().abs() @ deq.abs().t())
    # the output is x's dtype (bf16): its rounding on top
    assert ((y - ref).abs() <= bound + ref.abs() * 2 ** -8).all()
    assert y.shape == (m, n) and lin(x).dtype == torch.bfloat16


@pytest.mark.parametrize("threads", [1, 2])
def test_int8_gemv_row_alone_equals_row_in_batch(threads):
    """One row runs a different loop (several weight rows walked in lockstep) from a batch of rows: each output
    must still be bit-identical, whatever the thread count and however the rows split into runs and tails."""
    if not int8_gemv.available():
        pytest.skip("no C++ compiler")
    g = torch.Generator().manual_seed(3)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n, k in ((1, 64), (37, 96), (301, 4128), (1030, 896)):
            w, scale = _int8_parts(torch.randn(n, k, generator=g))
            x = torch.randn(11, k, generator=g).bfloat16()  # two passes (8 + 3 rows)
            batch = torch.ops.tokenhaul_int8.int8_gemv(x, w, scale.bfloat16())
            for i in range(11):
                assert torch.equal(torch.ops.tokenhaul_int8.int8_gemv(x[i:i + 1], w, scale.bfloat16())[0], batch[i])
    finally:
        torch.set_num_threads(old)


def _int8_parts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row int8 codes and bf16 scales for any width (Int8Linear.build asks for multiples of 16)."""
    scale = (w.abs().amax(dim=1) / 126.5).bfloat16().float()
    q = (w / torch.where(scale == 0, 1.0, scale)[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, scale.bfloat16()


@pytest.mark.parametrize("gemv", [True, False])
def test_int8_pinned_kernel_is_batch_invariant(gemv):
    """The batch-invariant factory pins one kernel at every row count: the C++ GEMV where it is built (each row
    summed alike in any pass), else the integer GEMM (exact int32 sums). Either way a row's output does not
    depend on which rows share its call, up to prefill-sized calls."""
    if gemv and not int8_gemv.available():
        pytest.skip("no C++ compiler")
    lin = LinearFactory(QuantSpec("int8"), torch.bfloat16).linear("a", [torch.randn(96, 160)])
    lin.gemv = gemv and lin.gemv
    lin.pin_one_kernel()
    assert all(lin.gemv_rows(m) for m in (1, 7, 8, 200)) if gemv else lin.packed_rows == 0
    x = torch.randn(200, 160)
    y = lin(x)
    assert all(torch.equal(lin(x[i:i + 1]), y[i:i + 1]) for i in (0, 17, 32, 199))
    assert torch.equal(lin(x[5:12]), y[5:12])


def test_int4_pinned_kernel_is_batch_invariant():
    """The batch-invariant factory's int4 linear keeps the C++ GEMV at every row count where a row sums alike in
    any batch (AVX-512 VNNI's 64-row blocks; AVX2's panels from 3 rows, fewer padded up), else int4pack: row i of
    an M-row call equals that row alone, bit for bit, from 1 row to prefill-sized calls."""
    from tokenhaul.layers import int4_gemv

    make = LinearFactory(QuantSpec("int4", 32), torch.bfloat16, batch_invariant=True)
    lin = make.linear("a", [torch.randn(130, 256)])
    rows = int4_gemv.invariant_from(32, lin.block) if int4_gemv.available() else None
    assert (lin.gemv_rows, lin.min_rows) == ((sys.maxsize, rows) if rows else (lin.gemv_rows, 1))
    assert lin.max_rows == (sys.maxsize if rows else None)
    x = torch.randn(150, 256).bfloat16()
    y = lin(x)
    alone = torch.cat([lin(x[i:i + 1]) for i in range(len(x))])
    for m in (1, 2, 3, 5, 64, 150):
        assert torch.equal(lin(x[:m]), alone[:m]), m
    assert torch.equal(y, alone)


def test_fused_parts_of_mixed_types_stack_along_out():
    parts = [gguf_weight(Q.Q4_1, 64, 256, 1), gguf_weight(Q.Q4_0, 32, 256, 2), torch.randn(40, 256) * 0.1]
    lin = Int4Linear.build(parts, None, torch.bfloat16, CPU, 32)
    assert (lin.out_features, lin.in_features) == (136, 256)
    ref = torch.cat([p.dequantize() if isinstance(p, GGUFWeight) else p for p in parts])
    assert (lin.dequantize()[:96] - ref[:96]).abs().max() <= ref[:96].abs().max() * 2 ** -7


def test_spec_parse_and_bad_group():
    assert QuantSpec.parse("int4") == QuantSpec("int4", 32)
    assert str(QuantSpec.parse("int4:128")) == "int4:128"
    with pytest.raises(TokenhaulError, match="int4:48: group must be one of 32, 64, 128"):
        QuantSpec.parse("int4:48")
    with pytest.raises(TokenhaulError, match="unknown quantization"):
        QuantSpec.parse("fp4")


def test_auto_choices_and_one_line_fallback(capsys):
    make = LinearFactory(QuantSpec("auto"), torch.bfloat16)
    assert make.linear("a", [gguf_weight(Q.Q4_1, 64, 256)]).format == "int4"
    assert make.linear("b", [gguf_weight(Q.Q8_0, 64, 256)]).format == "int8"
    assert make.linear("c", [gguf_weight(Q.Q4_1, 64, 256), gguf_weight(Q.Q8_0, 64, 256)]).format == "int8"
    assert make.linear("d", [torch.randn(64, 256)]).format == "dense"
    for name in ("e", "f"):
        lin = make.linear(name, [gguf_weight(Q.Q2_K, 64, 256)])
        assert lin.format == "dense"
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["tokenhaul: no packed kernel for GGUF type Q2_K; dequantized to bf16"]  # as --dtype says it
    exact = LinearFactory(QuantSpec("auto"), torch.float32)  # fp32 + auto: the exact path
    assert exact.linear("a", [gguf_weight(Q.Q4_1, 64, 256)]).format == "dense"


@pytest.mark.parametrize("cls", [Int4Linear, Int8Linear])
def test_state_round_trip(cls):
    lin = cls.build([torch.randn(70, 128)], torch.randn(70), torch.bfloat16, CPU, 64)
    again = cls.from_state(lin.state(), CPU)
    x = torch.randn(3, 128)
    assert torch.equal(lin(x), again(x)) and again.weight_bytes == lin.weight_bytes


@pytest.mark.parametrize("quant,min_cosine", [("int4", 0.9), ("int8", 0.998)])
def test_tiny_model_packed_tracks_dense(tiny_core, quant, min_cosine):
    """A whole engine over packed linears: prompt logits close to the dense bf16 model's (random tiny
    weights have near-flat logits, so greedy tokens are too fragile to compare), then a full run."""
    from drive import run_requests
    from tiny_models import tiny_model

    from tokenhaul.engine.core import EngineCore
    from tokenhaul.sampling_params import SamplingParams

    dense = tiny_core(dtype="bf16")
    packed = EngineCore(dense.config, tiny_model(make=LinearFactory(QuantSpec.parse(quant), torch.bfloat16)))
    assert packed.model.layers[0].qkv.format == quant and packed.model.lm_head.format == quant
    logits = []
    for core in (dense, packed):
        core.add_request("q", list(range(1, 30)), SamplingParams(max_tokens=1))
        inp = core.runner.prepare(core.scheduler.schedule())
        with torch.inference_mode():
            logits.append(core.model.compute_logits(core.model.forward(inp.input_ids, inp.meta, core.kv)))
        core.abort("q")
    cos = torch.nn.functional.cosine_similarity(logits[0], logits[1], dim=-1)
    assert cos.mean() >= min_cosine, cos
    out = run_requests(packed, [[3, 4, 5], [9] * 7], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert [len(o) for o in out] == [8, 8]


def test_weight_cache_round_trip_is_aligned(tmp_path):
    """Cached linears come back equal and in fresh memory (the int8 kernel crashes on safetensors'
    8-byte-aligned buffers once it has more than a few rows)."""
    from tokenhaul.models.weight_cache import WeightCache

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x" * 10)
    cache = WeightCache(tmp_path, gguf, QuantSpec("auto"), "cpu")
    lins = {"a": Int8Linear.build([torch.randn(64, 96)], None, torch.bfloat16, CPU),
            "b": Int4Linear.build([torch.randn(80, 64)], torch.randn(80), torch.bfloat16, CPU, 32)}
    cache.save(lins)
    make = LinearFactory(QuantSpec("int8"), torch.bfloat16, cache=cache.load())
    again = make.linear("a", [torch.zeros(64, 96)])  # taken from the cache, not from these parts
    assert not make.built and again.weight.data_ptr() % 64 == 0
    x = torch.randn(40, 96)
    assert torch.equal(again(x), lins["a"](x))
    b = LinearFactory(QuantSpec("int4"), torch.bfloat16, cache=cache.load()).linear("b", [torch.zeros(80, 64)])
    assert torch.equal(b(x[:, :64]), lins["b"](x[:, :64]))


@pytest.mark.parametrize("quant", ["none", "int8", "int4", "int8-sparse", "int4-sparse"])
def test_linears_take_zero_rows(quant):
    """A prefill chunk that samples no row asks the lm_head for logits of 0 rows: every format answers [0, out]
    (the int8 GEMV refused M = 0, so a prompt longer than one step's token budget failed on SmolLM2)."""
    fmt, _, sparse = quant.partition("-")
    model = tiny_model("llama", make=LinearFactory(QuantSpec.parse(fmt), torch.bfloat16))
    if sparse:
        sparsify(model, {"blk.0.qkv": 0.02, "lm_head": 0.02}, 0.4)
    for lin in (model.lm_head, model.layers[0].qkv):
        y = lin(torch.zeros(0, lin.in_features, dtype=torch.bfloat16))
        assert y.shape == (0, lin.out_features)
