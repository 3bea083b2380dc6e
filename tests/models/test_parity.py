"""Logits and greedy parity with transformers (fp32, same GGUF) on the three test models.

Tolerance: max |Δlogit| < 2e-3. Both sides compute in fp32 from the same dequantized weights; they
differ only in reduction order (fused QKV / gate-up GEMMs, SDPA kernels), which over 18-30 layers
gives errors of ~1e-5 relative — we measured 5e-5 (SmolLM2, Qwen) and 3e-4 (Gemma3) on logits of
magnitude 30-70. 2e-3 leaves room for other BLAS paths while still catching any real mistake
(a wrong RoPE, norm or scale moves logits by >0.1).
"""

from __future__ import annotations

import gc

import pytest
import torch

from tokenhaul.llm import LLM
from tokenhaul.sampling_params import SamplingParams

pytestmark = pytest.mark.real_model
TOL = 2e-3
PROMPTS = [
    "The history of the printing press begins",
    "请用一句话介绍长城。长城是",
    "I love 🍕 and 🎉 because 🙂",
    "def quicksort(arr):\n    if len(arr) <= 1:\n",
    "Ünïcödé façade — naïve café, 東京 and Zürich:",
]


def hf_model(llm: LLM):
    from transformers import AutoModelForCausalLM

    path = llm.files.gguf_path
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                dtype=torch.float32).eval()


@torch.inference_mode()
def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    out = hf(torch.tensor([ids]), use_cache=True)
    past, toks = out.past_key_values, []
    for _ in range(n):
        tok = int(out.logits[0, -1].argmax())
        toks.append(tok)
        out = hf(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
    return toks


@torch.inference_mode()
def engine_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Logits at every prompt position from our paged forward (prefill of one sequence)."""
    from tokenhaul.engine.scheduler import ScheduledChunk, SchedulerOutput

    core = llm.core
    core.add_request("parity", ids, SamplingParams(max_tokens=1))
    sched = core.scheduler.schedule()
    inp = core.runner.prepare(sched)
    hidden = llm.model.forward(inp.input_ids, inp.meta, core.kv)
    logits = llm.model.compute_logits(hidden)
    core.abort("parity")
    assert isinstance(sched.chunks[0], ScheduledChunk) and isinstance(sched, SchedulerOutput)
    return logits


@pytest.fixture(scope="module", params=["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"])
def pair(request):
    llm = LLM(request.param, dtype="fp32", max_num_batched_tokens=2048, enable_prefix_caching=False)
    hf = hf_model(llm)
    yield llm, hf
    del llm, hf
    gc.collect()


def test_logits_and_greedy_parity(pair):
    llm, hf = pair
    for text in PROMPTS:
        ids = llm.tokenizer.encode(text)
        ours = engine_logits(llm, ids)
        with torch.inference_mode():
            ref = hf(torch.tensor([ids])).logits[0]
        diff = (ours - ref).abs().max().item()
        assert diff < TOL, f"{llm.files.name} {text!r}: max |Δlogit| = {diff}"
        want = hf_greedy(hf, ids, 32)
        got = llm.generate(ids, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0].token_ids
        assert got == want, f"{llm.files.name} {text!r}"


def test_long_prompt_parity(pair):
    """600+ tokens: past Gemma3's 512-token sliding window, so local layers must mask correctly."""
    llm, hf = pair
    text = " ".join(f"Item {i} is a {'red' if i % 3 else 'blue'} parcel." for i in range(90))
    ids = llm.tokenizer.encode(text)
    assert len(ids) > 600
    ours = engine_logits(llm, ids)[-8:]
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0, -8:]
    assert (ours - ref).abs().max().item() < TOL
