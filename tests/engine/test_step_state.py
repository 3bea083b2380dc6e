"""engine/step_state.py: the walk that finds every tensor a step reads, and binding stand-ins in their place."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model

from tokenhaul.engine.step_state import bound, tensor_slots
from tokenhaul.kv.cache import KVCache


def test_slots_cover_a_models_tensors_once():
    """Every tensor the model holds (norms, rope tables, linears, the embedding) is found; a norm reached twice
    (`next_norm`) is walked once; the KV cache's layers are list entries."""
    model = tiny_model("llama")
    slots = tensor_slots(model)
    found = {id(s.get()) for s in slots}
    layer = model.layers[0]
    for t in (layer.attn_norm.weight, layer.ffn_norm.weight, model.norm.weight, model.rope.cos, model.embed.weight,
              *layer.qkv.tensors(), *model.lm_head.tensors()):
        assert id(t) in found
    assert len(slots) == len({(id(s.holder), s.key) for s in slots})
    kv = KVCache(2, 4, 4, 2, 16, torch.bfloat16, "cpu")
    assert [s.get() for s in tensor_slots(kv)] == [*kv.k, *kv.v]


def test_bound_puts_the_tensors_back():
    kv = KVCache(2, 4, 4, 2, 16, torch.bfloat16, "cpu")
    slots = tensor_slots(kv)
    before = [s.get() for s in slots]
    stand_ins = [torch.empty(0) for _ in slots]
    with pytest.raises(RuntimeError), bound(slots, stand_ins):
        assert all(s.get() is t for s, t in zip(slots, stand_ins))
        raise RuntimeError("a failed trace")
    assert all(s.get() is t for s, t in zip(slots, before))


def test_tensors_in_a_tuple_are_refused():
    class Part:
        pass

    Part.__module__ = "tokenhaul.test"
    part = Part()
    part.pair = (torch.zeros(1), torch.zeros(1))
    with pytest.raises(TypeError, match="tuple"):
        tensor_slots(part)
