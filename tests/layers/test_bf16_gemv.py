"""The few-row bf16 GEMV (layers/bf16_gemv.cpp) and DenseLinear's use of it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenhaul.layers import bf16_gemv
from tokenhaul.layers.linear_dense import DenseLinear

pytestmark = pytest.mark.skipif(not bf16_gemv.available(), reason="no C++ compiler")
CPU = torch.device("cpu")


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 8), k=st.integers(1, 300), n=st.integers(1, 70), fp32_x=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_gemv_matches_fp32_sums(m: int, k: int, n: int, fp32_x: bool, seed: int) -> None:
    """Any shape (inputs not a multiple of 16, rows not a multiple of the runs per thread, 1-8 rows): the fp32 sums of
    the bf16 weights times x, within fp32 rounding."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(m, k, generator=g)
    x = x if fp32_x else x.bfloat16()
    y = torch.ops.tokenhaul_bf16.bf16_gemv(x, w)
    ref = x.double() @ w.double().t()
    assert y.dtype == torch.float32 and y.shape == (m, n)
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5 * (1 + float(ref.abs().max())))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_row_does_not_depend_on_its_batch_or_threads(threads: int) -> None:
    """Each (weight row, activation row) is summed the same way with 1, 3 or 8 rows a call and any thread count."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(1000, 576, generator=g).bfloat16()
    x = torch.randn(8, 576, generator=g).bfloat16()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        full = torch.ops.tokenhaul_bf16.bf16_gemv(x, w)
        parts = [torch.ops.tokenhaul_bf16.bf16_gemv(x[i:i + 3], w) for i in range(0, 8, 3)]
    finally:
        torch.set_num_threads(before)
    assert torch.equal(full, torch.cat(parts))
    assert torch.equal(full[:1], torch.ops.tokenhaul_bf16.bf16_gemv(x[:1], w))


def test_dense_linear_takes_the_gemv_for_few_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 DenseLinear calls the GEMV up to 8 rows (bias added, x's dtype out) and F.linear beyond; fp32 weights
    never do; batch_invariant (--deterministic) linears keep one kernel."""
    g = torch.Generator().manual_seed(5)
    w, b = torch.randn(48, 32, generator=g), torch.randn(48, generator=g)
    lin = DenseLinear.build([w.bfloat16()], b, torch.bfloat16, CPU)
    assert lin.gemv and not DenseLinear.build([w], b, torch.float32, CPU).gemv
    calls = []
    op = torch.ops.tokenhaul_bf16.bf16_gemv

    class Spy:
        def bf16_gemv(self, *args):
            calls.append(args[0].shape[0])
            return op(*args)

    monkeypatch.setattr(torch.ops, "tokenhaul_bf16", Spy())
    for m in (1, 8, 9):
        x = torch.randn(m, 32, generator=g).bfloat16()
        y = lin(x)
        assert y.dtype == torch.bfloat16
        ref = x.float() @ w.bfloat16().float().t() + b
        assert torch.allclose(y.float(), ref, rtol=2e-2, atol=2e-2)
    assert calls == [1, 8]
