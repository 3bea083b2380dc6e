"""Prompt logprobs (SamplingParams.prompt_logprobs): each prompt token's logprob given the tokens before it, as a
full forward over the prompt computes it, whatever the chunking, the batch or the prefix cache."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from tiny_models import tiny_model

from tokenhaul.config import EngineConfig
from tokenhaul.engine.core import EngineCore
from tokenhaul.engine.step_time import StepTimeModel, default_knots
from tokenhaul.sampling_params import SamplingParams

PROMPT = [(i * 37) % 96 + 1 for i in range(23)]
K = 3


def full_forward_logprobs(tiny_core, prompt: list[int]) -> torch.Tensor:
    """log_softmax [len(prompt), vocab] of one forward over the whole prompt (row i predicts token i + 1)."""
    core = tiny_core(enable_prefix_caching=False)
    core.add_request("ref", prompt, SamplingParams(max_tokens=1, temperature=0))
    inp = core.runner.prepare(core.scheduler.schedule())
    assert [c.num_tokens for c in inp.sample_chunks] == [len(prompt)]
    with torch.inference_mode():
        return torch.log_softmax(core.model.compute_logits(core.model.forward(inp.input_ids, inp.meta, core.kv)), -1)


def drive(core, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list]:
    """Run requests to the end; each one's deltas in order."""
    for rid, (prompt, params) in requests.items():
        core.add_request(rid, prompt, params)
    deltas = {rid: [] for rid in requests}
    while core.has_unfinished():
        for d in core.step():
            deltas[d.request_id].append(d)
    return deltas


def prompt_logprobs_of(deltas: list) -> list:
    """The prompt logprobs a request's deltas carry: all in the first delta, none in the others."""
    assert all(d.prompt_logprobs is None for d in deltas[1:])
    return deltas[0].prompt_logprobs


def check_against(ref: torch.Tensor, prompt: list[int], got: list, k: int = K) -> None:
    """got equals the full forward's logprobs at every prompt position (fp32, attention summed in other orders)."""
    assert len(got) == len(prompt) and got[0] is None
    for i, s in enumerate(got[1:], 1):
        row = ref[i - 1]
        assert s.token == prompt[i] and math.isclose(s.logprob, float(row[prompt[i]]), abs_tol=1e-5)
        v = float(row[prompt[i]])  # rank: the tokens at least as likely (vLLM's), up to near-ties in either sum
        assert int((row > v + 1e-4).sum()) + 1 <= s.rank <= int((row >= v - 1e-4).sum())
        top = torch.topk(row, k)
        assert [t for t, _ in s.top_logprobs] == top.indices.tolist()
        assert all(math.isclose(lp, v, abs_tol=1e-5) for (_, lp), v in zip(s.top_logprobs, top.values.tolist()))


@pytest.mark.parametrize("budget", [512, 5, 4])
def test_prompt_logprobs_equal_a_full_forward(tiny_core, budget):
    """Whole, or in chunks of 5 and 4 tokens (the row that ends a chunk predicts the next chunk's first token)."""
    ref = full_forward_logprobs(tiny_core, PROMPT)
    core = tiny_core(max_num_batched_tokens=budget)
    core.observer = rows = RowCounter()
    deltas = drive(core, {"a": (PROMPT, SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=K))})
    check_against(ref, PROMPT, prompt_logprobs_of(deltas["a"]))
    assert rows.rows == len(PROMPT) - 1  # each position's logits once; none for the decode steps


def test_k_zero_gives_the_tokens_logprob_only_and_one_token_prompts_none(tiny_core):
    ref = full_forward_logprobs(tiny_core, PROMPT)
    deltas = drive(tiny_core(), {"a": (PROMPT, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0)),
                                 "b": ([7], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=5))})
    got = prompt_logprobs_of(deltas["a"])
    assert all(s.top_logprobs is None for s in got[1:])
    assert [s.logprob for s in got[1:]] == pytest.approx([float(ref[i - 1, PROMPT[i]]) for i in range(1, 23)],
                                                          abs=1e-5)
    assert prompt_logprobs_of(deltas["b"]) == [None]


@pytest.mark.parametrize("budget", [512, 8])
def test_a_request_batched_with_one_asking_is_unchanged(tiny_core, budget):
    """Only the request that asks pays for prompt logits: the other's tokens and logprobs are bit for bit those
    it gets beside the same request not asking; its deltas carry no prompt logprobs."""
    other = ([(i * 11) % 90 + 3 for i in range(17)], SamplingParams(max_tokens=6, temperature=0, logprobs=2))

    def run(prompt_logprobs):
        asking = (PROMPT, SamplingParams(max_tokens=6, temperature=0, prompt_logprobs=prompt_logprobs))
        return drive(tiny_core(max_num_batched_tokens=budget), {"a": asking, "b": other})

    with_, without = run(K), run(None)
    check_against(full_forward_logprobs(tiny_core, PROMPT), PROMPT, prompt_logprobs_of(with_["a"]))
    assert all(d.prompt_logprobs is None for d in with_["b"] + without["a"] + without["b"])
    for rid in "ab":
        assert [(d.new_token_ids, d.samples) for d in with_[rid]] == [(d.new_token_ids, d.samples)
                                                                       for d in without[rid]]


def test_a_cached_prompt_is_computed_again(tiny_core):
    """The prompt's blocks are in the prefix cache (an earlier request): a request asking for prompt logprobs
    takes no hit (as vLLM v1) and still gets every position; a later one not asking does hit."""
    ref = full_forward_logprobs(tiny_core, PROMPT)
    core = tiny_core()
    greedy = SamplingParams(max_tokens=3, temperature=0)
    first = drive(core, {"a": (PROMPT, greedy)})
    hits = core.prefix_cache.hit_tokens
    deltas = drive(core, {"b": (PROMPT, SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=K))})
    check_against(ref, PROMPT, prompt_logprobs_of(deltas["b"]))
    assert core.prefix_cache.hit_tokens == hits
    again = drive(core, {"c": (PROMPT, greedy)})
    assert core.prefix_cache.hit_tokens == hits + 20  # 5 full blocks of 4, the last token left to compute
    assert [d.new_token_ids for d in deltas["b"]] == [d.new_token_ids for d in first["a"]] \
        == [d.new_token_ids for d in again["c"]]


def test_a_cached_prompt_is_computed_again_under_an_inter_token_budget(tiny_core):
    """The same with the stall-free scheduler (itl_target_ms, chunks sized by a fixed step-time model: 2 ms a
    step and 0.1 ms a token), the prompt chunked beside a running decode."""
    ref = full_forward_logprobs(tiny_core, PROMPT)
    knots = default_knots(16)
    step_time = StepTimeModel(knots, [2e-3 + 1e-4 * k for k in knots], [0.0] * 4, alpha=0.0)
    cfg = EngineConfig(model="tiny", dtype="fp32", num_kv_blocks=64, block_size=4, max_num_batched_tokens=16,
                       itl_target_ms=3.0)
    core = EngineCore(cfg, tiny_model(), step_time=step_time)
    drive(core, {"a": (PROMPT, SamplingParams(max_tokens=3, temperature=0))})
    hits = core.prefix_cache.hit_tokens
    core.observer = chunks = ChunkLog()
    deltas = drive(core, {"d": ([5, 6, 7], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)),
                          "b": (PROMPT, SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=K))})
    check_against(ref, PROMPT, prompt_logprobs_of(deltas["b"]))
    assert core.prefix_cache.hit_tokens == hits
    assert chunks.starts["b"][0] == 0 and chunks.starts["b"][1] < len(PROMPT) - 1  # the prompt in chunks


def test_the_step_time_model_is_told_of_the_prompt_rows(tiny_core):
    """Under an inter-token budget a chunk's prompt-logprob rows count as lm_head rows in the step's shape (the
    model predicts and learns from the step as it runs), and so shrink the chunk."""
    knots = default_knots(128)  # 1 ms a step, 0.1 ms a token and 0.1 ms an lm_head row
    step_time = StepTimeModel(knots, [1e-3 + 1e-4 * k for k in knots], [1e-4, 0.0, 0.0, 0.0], alpha=0.0)
    cfg = EngineConfig(model="tiny", dtype="fp32", num_kv_blocks=64, block_size=4, max_num_batched_tokens=128,
                       itl_target_ms=7.0)
    sizes = []
    for k in (None, K):
        core = EngineCore(cfg, tiny_model(), step_time=step_time)
        core.add_request("d", [5, 6, 7], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        core.step()  # a running decode: the step has a budget
        core.add_request("b", PROMPT * 5, SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=k))
        sched = core.scheduler.schedule()
        decode, c = sched.chunks
        assert sched.shape.sampled == decode.num_sampled + c.num_sampled + len(c.prompt_positions)
        sizes.append(c.num_tokens)
    assert 20 < sizes[1] < sizes[0] and abs(2 * sizes[1] - sizes[0]) <= 2  # a row per token costs a token


def test_preempted_mid_prompt_collects_each_position_once(tiny_core):
    """A pool too small for the batch preempts requests whose prompts are half done: recomputed, their prompt
    logprobs are still one per prompt token, equal to the full forward's."""
    prompts = [[(i * (7 + j)) % 95 + 2 for i in range(21 + j)] for j in range(4)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, prompt_logprobs=K)
    core = tiny_core(num_kv_blocks=14, max_num_batched_tokens=12)
    deltas = drive(core, {f"r{j}": (p, params) for j, p in enumerate(prompts)})
    assert core.scheduler.num_preemptions > 0
    for j, p in enumerate(prompts):
        check_against(full_forward_logprobs(tiny_core, p), p, prompt_logprobs_of(deltas[f"r{j}"]))


def test_with_speculation_the_prompt_and_the_drafts_are_apart(tiny_core):
    """prompt_lookup drafts once the prompt is done: the prompt logprobs are the plain ones, the verified drafts
    give no prompt rows, the tokens are greedy decoding's."""
    prompt = PROMPT + PROMPT[:10]  # a repeat for prompt lookup to find
    ref = full_forward_logprobs(tiny_core, prompt)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, prompt_logprobs=K)
    plain = drive(tiny_core(max_num_batched_tokens=6), {"a": (prompt, params)})
    core = tiny_core(max_num_batched_tokens=6)
    core.observer = rows = RowCounter()
    deltas = drive(core, {"a": (prompt, replace(params, speculative="prompt_lookup"))})
    assert rows.proposed > 0 and rows.rows == len(prompt) - 1
    check_against(ref, prompt, prompt_logprobs_of(deltas["a"]))
    assert [t for d in deltas["a"] for t in d.new_token_ids] == [t for d in plain["a"] for t in d.new_token_ids]


class RowCounter:
    def __init__(self):
        self.rows = 0
        self.proposed = 0

    def on_step(self, record):
        self.rows += record.prompt_logprob_rows
        self.proposed += sum(p for _, p, _ in record.speculation)

    def on_finish(self, request):
        pass


@pytest.mark.real_model
def test_real_model_prompt_logprobs_are_the_generated_tokens_logprobs(smollm):
    """SmolLM2-135M (fp32): text the model generated, given back as a prompt, gets at each generated token the
    logprob the model gave it when generating (prefill's attention sums in other orders than decode's: within
    2e-5, seen up to 3.3e-6), and that token heads its top list (greedy took the argmax)."""
    prompt = smollm.tokenizer.encode("The capital of France is")
    gen = smollm.generate(prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0))[0]
    assert gen.prompt_logprobs is None
    forced = smollm.generate(prompt + gen.token_ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))[0]
    got = forced.prompt_logprobs
    assert len(got) == len(prompt) + 6 and got[0] is None
    ids = prompt + gen.token_ids
    assert all(t in d for d, t in zip(got[1:], ids[1:]))  # vLLM's dicts: token id -> Logprob
    for d, g, t in zip(got[len(prompt):], gen.outputs[0].logprobs, gen.token_ids):
        assert abs(d[t].logprob - g[t].logprob) < 2e-5
        assert len(d) == 2 and d[t].rank == g[t].rank == 1  # greedy took the argmax: it heads the top 2
    for d, t in zip(got[1:], ids[1:]):
        best, = (v for v in d.values() if v.rank == 1)
        assert d[t].logprob <= 0 and best.logprob >= d[t].logprob


class ChunkLog:
    def __init__(self):
        self.starts = {}

    def on_step(self, record):
        for rid, start, _ in record.chunks:
            self.starts.setdefault(rid, []).append(start)

    def on_finish(self, request):
        pass
