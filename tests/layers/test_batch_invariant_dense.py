"""--deterministic's dense bf16 linears (`--quantization none`): a row's output must not depend on how many rows
share the call (README: the same tokens whatever else is batched)."""

from __future__ import annotations

import pytest
import torch

from tokenhaul.layers import bf16_gemv
from tokenhaul.layers.quantization import LinearFactory, QuantSpec

CPU = torch.device("cpu")
ROWS = (1, 2, 3, 8, 17, 64, 200)


@pytest.mark.parametrize("gemv", [True, False], ids=["gemv", "no-compiler"])
@pytest.mark.parametrize("k, n", [(1536, 576), (576, 1536), (576, 960), (100, 37)])
def test_a_bf16_row_is_the_same_alone_or_batched(k: int, n: int, gemv: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """SmolLM2's shapes (down 1536→576, up/gate 576→1536, fused qkv 576→960) and one whose input is not a multiple
    of 16, built the --deterministic way: row i of an M-row call equals that row alone, bit for bit, for every M
    (torch's bf16 F.linear gave other numbers for some rows of the 1536→576 one at 64 rows). With the C++ GEMV and
    without it (no compiler)."""
    if gemv and not bf16_gemv.available():
        pytest.skip("no C++ compiler")
    if not gemv:
        monkeypatch.setattr(bf16_gemv, "available", lambda: False)
    g = torch.Generator().manual_seed(k * 7 + n)
    w = (torch.randn(n, k, generator=g) / k**0.5).bfloat16()
    lin = LinearFactory(QuantSpec("none"), torch.bfloat16, CPU, batch_invariant=True).linear("blk.0.x", [w])
    assert lin.gemv == gemv
    x = torch.randn(max(ROWS), k, generator=g).bfloat16()
    alone = torch.cat([lin(x[i:i + 1]) for i in range(max(ROWS))])
    for m in ROWS:
        batched = lin(x[:m])
        assert batched.dtype == torch.bfloat16 and batched.shape == (m, n)
        bad = (batched != alone[:m]).any(dim=1).nonzero().flatten().tolist()
        assert not bad, f"M={m}: rows {bad[:8]} differ from the same rows alone"
