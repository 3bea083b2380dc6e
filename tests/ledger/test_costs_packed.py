"""Packed weights: the ledger counts the bytes the packed kernels read (weights, scales, gathered embedding
rows), checked against the independent op-level count, and its findings say the weights run packed."""

from __future__ import annotations

import pytest
import torch
from probe import TrafficCounter
from test_costs import GREEDY
from tiny_models import tiny_model

from tokenhaul.config import EngineConfig
from tokenhaul.engine.core import EngineCore
from tokenhaul.layers.quantization import LinearFactory, QuantSpec
from tokenhaul.ledger.costs import ModelCosts
from tokenhaul.ledger.findings import findings
from tokenhaul.ledger.ledger import Ledger
from tokenhaul.whatif.roofline import Roofline


@pytest.mark.parametrize("quant", ["int4", "int4:64", "int8"])
def test_packed_bytes_equal_independent_count(quant):
    cfg = EngineConfig(model="tiny", dtype="bf16", num_kv_blocks=64, block_size=4)
    model = tiny_model(make=LinearFactory(QuantSpec.parse(quant), torch.bfloat16), vocab_size=128, ffn_size=128)
    core = EngineCore(cfg, model)
    costs = ModelCosts.from_model(model, 2)
    assert costs.packed and dict(costs.weight_formats) == {quant.split(":")[0]: 9}
    dense = ModelCosts.from_model(tiny_model(dtype=torch.bfloat16, vocab_size=128, ffn_size=128), 2)
    assert costs.layer_weight_bytes < 0.6 * dense.layer_weight_bytes  # 4.5 or 8 bits instead of 16
    core.observer = ledger = Ledger(costs)
    for i, n in enumerate([5, 9, 14]):
        core.add_request(f"r{i}", [(7 * i + 3 * j) % 90 + 1 for j in range(n)], GREEDY)
    steps = 0
    while core.has_unfinished():
        with TrafficCounter(core.model, core.kv) as tc:
            core.step()
        c = ledger.steps[-1].costs
        assert c.weight_bytes == pytest.approx(tc.weight_bytes, rel=0.02)
        assert c.flops == pytest.approx(tc.flops, rel=0.02)
        steps += 1
    assert steps >= 8
    text = " ".join(f.answer for f in findings(ledger, Roofline(20e9, 100e9, "test machine")))
    assert "dequantized at load" not in text and "weights run packed" in text
