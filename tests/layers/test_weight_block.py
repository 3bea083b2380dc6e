"""A model's weights moved into one huge-page block: same values, same views, one copy of a tied table,
every storage on a cache line, and the same logits after the move."""

from __future__ import annotations

import pytest
import torch

from tokenhaul.layers.quantization import LinearFactory, QuantSpec
from tokenhaul.layers.weight_block import HUGE_PAGE, gather_weights, huge_page_block
from tokenhaul.sampling_params import SamplingParams


class Holder:
    def __init__(self, *weights: str) -> None:
        self.weights = weights

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in self.weights]


def test_block_starts_on_a_huge_page():
    block = huge_page_block(3 * HUGE_PAGE + 5)
    assert block.numel() == 3 * HUGE_PAGE + 5 and block.data_ptr() % HUGE_PAGE == 0
    block.fill_(7)
    assert int(block[-1]) == 7


def test_values_views_and_shared_storages_survive():
    a, b = Holder("w", "bias", "codes"), Holder("tied", "tail")
    w = torch.randn(300, 70).bfloat16()
    a.w, a.wt, a.bias = w, w.t(), torch.randn(5)  # wt: a view of a weight, not one itself
    a.codes = torch.randint(-128, 128, (33, 7), dtype=torch.int8)
    a.counter = torch.zeros(2, dtype=torch.long)  # state a kernel writes: not a weight, stays
    b.tied, b.tail, b.not_a_tensor = w, torch.arange(100.0)[10:20], [w]
    before = {(id(h), k): v.clone() for h in (a, b) for k, v in vars(h).items() if isinstance(v, torch.Tensor)}
    moved = gather_weights([a, b])
    assert moved == sum(-(-n // 64) * 64 for n in (300 * 70 * 2, 5 * 4, 33 * 7, 100 * 4))  # each storage once
    for h in (a, b):
        for k, v in vars(h).items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(v, before[(id(h), k)]) and v.dtype == before[(id(h), k)].dtype, k
                assert v.data_ptr() % 4 == 0
    storage = a.w.untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == storage for t in (a.wt, a.bias, a.codes, b.tied, b.tail))
    assert a.counter.untyped_storage().data_ptr() != storage
    assert a.wt.stride() == (1, 70) and b.tail.shape == (10,)
    a.w[0, 0] = 3.0  # still one copy: the transposed view and the tied table see the write
    assert float(a.wt[0, 0]) == 3.0 and float(b.tied[0, 0]) == 3.0
    assert b.not_a_tensor[0] is w  # only tensor attributes move
    assert gather_weights([a, b]) == 0  # already in a block: nothing moves twice


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_logits_unchanged_after_the_move(tiny_core, quantization):
    from tiny_models import tiny_model

    from tokenhaul.engine.core import EngineCore

    make = LinearFactory(QuantSpec.parse(quantization), torch.bfloat16)
    core = EngineCore(tiny_core(dtype="bf16").config, tiny_model(make=make))

    def logits():
        core.add_request("q", list(range(1, 30)), SamplingParams(max_tokens=1))
        inp = core.runner.prepare(core.scheduler.schedule())
        with torch.inference_mode():
            out = core.model.compute_logits(core.model.forward(inp.input_ids, inp.meta, core.kv))
        core.abort("q")
        return out

    before = logits()
    assert gather_weights(make.made) > 0
    assert torch.equal(logits(), before)
    storages = {t.untyped_storage().data_ptr() for lin in make.made for t in lin.tensors()}
    assert len(storages) == 1
