"""The default (packed) path against the same weights in fp32, on SmolLM2: greedy top-1 agreement over
20 prompts × 32 tokens, each position scored with the fp32 continuation as context (teacher-forced, so
one early disagreement does not make every later position differ)."""

from __future__ import annotations

import pytest
import torch

from tokenhaul.sampling_params import SamplingParams

pytestmark = pytest.mark.real_model
PROMPTS = [f"Write one sentence about {t}." for t in (
    "the ocean", "a robot", "Paris", "quantum computing", "a cat", "bread baking", "the moon", "trains", "chess",
    "volcanoes", "jazz", "a library", "winter", "bees", "bridges", "tea", "rivers", "maps", "glass", "clocks")]


def top1(llm, ids: list[int]) -> torch.Tensor:
    core = llm.core
    core.add_request("agree", ids, SamplingParams(max_tokens=1))
    try:
        inp = core.runner.prepare(core.scheduler.schedule())
        with torch.inference_mode():
            return llm.model.compute_logits(llm.model.forward(inp.input_ids, inp.meta, core.kv)).argmax(-1)
    finally:
        core.abort("agree")


def test_auto_agrees_with_fp32_greedy(smollm):
    from tokenhaul.llm import LLM

    auto = LLM("smollm2-135m", enable_prefix_caching=False)
    assert auto.costs.packed and smollm.config.dtype == "fp32" and not smollm.costs.packed
    outs = smollm.generate(PROMPTS, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    same = total = 0
    for o in outs:
        ids = o.prompt_token_ids + o.token_ids[:-1]
        n = len(o.token_ids)  # positions whose next token fp32 chose greedily
        got = top1(auto, ids)[-n:].tolist()
        same += sum(a == b for a, b in zip(got, o.token_ids))
        total += n
    assert total == 20 * 32
    assert same / total >= 0.95, same / total
    # the loader moved every linear and the embedding into one huge-page block (layers/weight_block.py)
    model = auto.model
    holders = [model.embed, model.lm_head, *(lin for layer in model.layers
                                             for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))]
    storages = {t.untyped_storage().data_ptr() for h in holders for t in h.tensors()}
    assert len(storages) == 1 and model.layers[0].qkv.weight.data_ptr() % 64 == 0
