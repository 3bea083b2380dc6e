"""Engine core on the real default model (SmolLM2-135M, fp32)."""

from __future__ import annotations

import pytest
import torch
from drive import run_requests

from tokenhaul.config import EngineConfig
from tokenhaul.engine.core import EngineCore
from tokenhaul.errors import RequestError
from tokenhaul.llm import LLM
from tokenhaul.sampling_params import SamplingParams

pytestmark = pytest.mark.real_model
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
TOPICS = ["the ocean", "a robot", "Paris", "quantum computing", "a cat", "bread baking", "the moon", "trains",
          "chess", "volcanoes", "jazz", "a library", "winter", "bees", "bridges", "tea"]


def test_batch_invariance_16_prompts(smollm):
    prompts = [f"Write one sentence about {t}." for t in TOPICS]
    alone = [smollm.generate(p, GREEDY)[0].token_ids for p in prompts]
    together = [o.token_ids for o in smollm.generate(prompts, GREEDY)]
    assert together == alone


def test_prefix_cache_1000_token_prefix(smollm):
    shared = " ".join(f"Fact {i}: parcel {i * 7 % 13} travels by {'rail' if i % 2 else 'road'}." for i in range(84))
    ids = smollm.tokenizer.encode(shared)
    assert len(ids) >= 1000
    a = ids + smollm.tokenizer.encode(" Question one: which parcels go by rail?")
    b = ids + smollm.tokenizer.encode(" Question two: what is parcel 5?")
    cold = EngineCore(EngineConfig(dtype="fp32", enable_prefix_caching=False), smollm.model)
    (cold_out,) = run_requests(cold, [b], GREEDY)
    smollm.generate(a, GREEDY)
    hits_before = smollm.core.prefix_cache.hit_tokens
    out = smollm.generate(b, GREEDY)[0]
    assert out.token_ids == cold_out
    computed = sum(n for s in out.ledger.steps for _, _, n in s.record.chunks)
    block = smollm.config.block_size
    reused = (len(ids) // block) * block
    assert smollm.core.prefix_cache.hit_tokens - hits_before == reused
    assert computed == len(b) - reused + GREEDY.max_tokens - 1


def test_preemption_real_model(smollm):
    prompts = [smollm.tokenizer.encode(f"Tell me about {t}.") for t in TOPICS[:6]]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    ref = [o.token_ids for o in smollm.generate(prompts, params)]
    # 8 blocks × 16 = 128 slots for 6 requests of ~32 tokens each
    core = EngineCore(EngineConfig(dtype="fp32", num_kv_blocks=8, block_size=16), smollm.model)
    assert run_requests(core, prompts, params) == ref
    assert core.scheduler.num_preemptions > 0
    assert core.pool.num_used == 0 and core.pool.num_free == 8


def test_abort_mid_generation_frees_blocks(smollm):
    core = EngineCore(EngineConfig(dtype="fp32", num_kv_blocks=32), smollm.model)
    core.add_request("a", smollm.tokenizer.encode("Count to one hundred:"),
                     SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
    for _ in range(4):
        core.step()
    assert core.pool.num_used > 0
    core.abort("a")
    assert core.pool.num_used == 0


def test_same_seed_same_text(smollm):
    p = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234)
    a, b = smollm.generate("Once upon a time", p)[0], smollm.generate("Once upon a time", p)[0]
    assert a.text == b.text and a.token_ids == b.token_ids
    c = smollm.generate("Once upon a time", SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=99))
    assert c[0].token_ids != a.token_ids
    d = smollm.generate("Once upon a time", sampling_params=p)[0]  # vLLM's keyword
    assert d.token_ids == a.token_ids
    unseeded = SamplingParams(max_tokens=8, temperature=0.9)
    seeded = LLM("smollm2-135m", seed=5, enforce_eager=True)  # vLLM's: unseeded requests draw reproducibly
    first = seeded.generate("Once upon a time", unseeded)[0].token_ids
    torch.manual_seed(5)  # the state LLM(seed=5) left
    assert seeded.generate("Once upon a time", unseeded)[0].token_ids == first
    e = smollm.chat([{"role": "user", "content": "Hi"}], sampling_params=SamplingParams(max_tokens=3))[0]
    assert len(e.token_ids) == 3
    prefill = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello th"}]
    f = smollm.chat(prefill, SamplingParams(max_tokens=1), add_generation_prompt=False, continue_final_message=True)
    assert smollm.tokenizer.decode(f[0].prompt_token_ids).endswith("assistant\nHello th")  # vLLM's LLM.chat arguments
    with pytest.raises(RequestError, match="chat_template_kwargs may not set messages"):
        smollm.chat(prefill, chat_template_kwargs={"messages": []})


def test_stop_string_never_leaks(smollm):
    ref = smollm.generate("1, 2, 3, 4,", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    assert " 7" in ref.text
    out = smollm.generate("1, 2, 3, 4,", SamplingParams(max_tokens=20, temperature=0, stop=[" 7"]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == " 7"
    assert " 7" not in out.text and ref.text.startswith(out.text)
    assert smollm.core.pool.num_used == 0


def test_logprobs_real(smollm):
    """vLLM's shape: per token a dict token id -> Logprob; greedy's token heads it (rank 1) among the top 3."""
    out = smollm.generate("The sky is", SamplingParams(max_tokens=4, temperature=0, logprobs=3))[0]
    assert len(out.outputs[0].logprobs) == len(out.token_ids)
    for d, tok in zip(out.outputs[0].logprobs, out.token_ids):
        assert len(d) == 3 and d[tok].rank == 1 and d[tok].logprob <= 0
        assert sorted(v.rank for v in d.values()) == [1, 2, 3]


def test_bf16_default_agrees_with_fp32(smollm):
    """The default dtype (bf16 weights and KV) against fp32: greedy top-1 agreement over a text's
    positions — the quality cost of halving the bytes, measured rather than assumed."""
    import torch

    from tokenhaul.llm import LLM

    bf16 = LLM("smollm2-135m")
    assert bf16.config.dtype == "bf16"
    ids = smollm.tokenizer.encode("The river carried parcels of silt from the mountains to the sea, where the "
                                  "delta grew a little every year. Farmers planted rice on the new land and "
                                  "the town built a harbour for the boats that took the harvest upstream.")
    tops = []
    for llm in (smollm, bf16):
        core = llm.core
        core.add_request("q", ids, SamplingParams(max_tokens=1))
        inp = core.runner.prepare(core.scheduler.schedule())
        with torch.inference_mode():
            logits = llm.model.compute_logits(llm.model.forward(inp.input_ids, inp.meta, core.kv))
        core.abort("q")
        tops.append(logits.argmax(-1))
    agreement = (tops[0] == tops[1]).float().mean().item()
    assert agreement >= 0.9, agreement


def test_bad_prompts_leave_the_llm_usable(smollm):
    """Token ids outside the vocabulary, or params not one per prompt, are refused before anything runs; the
    same LLM then serves a good prompt with nothing left over from the refused ones."""
    ref = smollm.generate("Water boils at", GREEDY)[0].token_ids
    for bad in ([[-1, 5]], [[5, smollm.model.config.vocab_size]], ["fine", [3, -2]]):
        with pytest.raises(RequestError, match="outside the vocabulary"):
            smollm.generate(bad, GREEDY)
        assert not smollm.core.has_unfinished()
    with pytest.raises(RequestError, match="sampling params for 2 prompts"):
        smollm.generate(["a b c", "d e f"], [GREEDY])
    assert smollm.generate("Water boils at", GREEDY)[0].token_ids == ref


def test_logit_bias_real(smollm):
    """+100 on one token id makes every greedy token that id; -100 on the raw greedy choice moves off it. The
    logprobs stay the model's raw ones (the forced token is unlikely there)."""
    ref = smollm.generate("The capital of France is", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                                                     logprobs=1))[0]
    tid = smollm.tokenizer.encode(" banana", add_special_tokens=False)[0]
    p = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=1, logit_bias={tid: 100})
    out = smollm.generate("The capital of France is", p)[0]
    assert out.token_ids == [tid] * 4 and out.text == smollm.tokenizer.decode([tid] * 4)
    first, ref_first = out.outputs[0].logprobs[0], ref.outputs[0].logprobs[0]
    top_id, = (t for t, v in first.items() if v.rank == 1)  # the raw top-1: the unbiased greedy token
    assert top_id == ref.token_ids[0] and first[top_id].logprob == pytest.approx(ref_first[top_id].logprob, abs=1e-4)
    assert first[tid].logprob < first[top_id].logprob and first[tid].rank > 1
    banned = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logit_bias={ref.token_ids[0]: -100})
    assert smollm.generate("The capital of France is", banned)[0].token_ids[0] != ref.token_ids[0]
    with pytest.raises(RequestError, match="logit_bias contains token id"):
        smollm.generate("x", SamplingParams(logit_bias={smollm.model.config.vocab_size: 1}))
    assert not smollm.core.has_unfinished()


def test_stop_reason_of_a_stop_token_id(smollm):
    """RequestOutput.stop_reason: the stop_token_ids id the request stopped at (an int, as vLLM's), the stop string
    matched (a str), or None."""
    ref = smollm.generate("1, 2, 3, 4,", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    stop = ref.token_ids[2]
    out = smollm.generate("1, 2, 3, 4,", SamplingParams(max_tokens=6, temperature=0, stop_token_ids=[stop]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop and out.token_ids[-1] == stop
    assert ref.stop_reason is None
