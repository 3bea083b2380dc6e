"""Speculation on tiny random models: greedy output equals plain greedy whatever the strategy and the
batch, drafts really get accepted, and every KV block comes back after rollbacks and aborts."""

import pytest
from drive import run_requests
from tiny_models import tiny_model

from tokenhaul.config import EngineConfig
from tokenhaul.engine.core import EngineCore
from tokenhaul.sampling_params import SamplingParams


def prompts(n, seed=3):
    import random

    rng = random.Random(seed)
    out = []
    for i in range(n):
        base = [rng.randrange(1, 97) for _ in range(6 + i % 4)]
        out.append(base * 3 + base[:2])  # repeats: prompt lookup has something to find
    return out


def greedy(spec="off", k=4, max_tokens=24):
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, speculative=spec,
                          num_speculative_tokens=k)


class SpecCounter:
    def __init__(self):
        self.proposed = self.accepted = self.rejected = 0

    def on_step(self, record):
        for _, p, a in record.speculation:
            self.proposed += p
            self.accepted += a
        self.rejected += record.rejected_tokens

    def on_finish(self, request):
        pass


def core_with(draft=False, **kw):
    cfg = EngineConfig(model="tiny", dtype="fp32", **({"num_kv_blocks": 64, "block_size": 4} | kw))
    return EngineCore(cfg, tiny_model(), draft_model=tiny_model(seed=1) if draft else None)


@pytest.mark.parametrize("spec", ["prompt_lookup", "jacobi", "draft"])
def test_greedy_equals_plain_alone_and_mixed(spec):
    ps = prompts(6)
    plain = run_requests(core_with(), ps, greedy())
    core = core_with(draft=spec == "draft")
    core.observer = counter = SpecCounter()
    assert run_requests(core, ps, greedy(spec)) == plain
    assert counter.proposed > 0 and counter.rejected == counter.proposed - counter.accepted
    assert core.pool.num_used == 0  # every draft's blocks came back
    mixed = core_with(draft=spec == "draft")
    for i, p in enumerate(ps):
        mixed.add_request(f"r{i}", p, greedy(spec if i % 2 else "off"))
    out = {f"r{i}": [] for i in range(len(ps))}
    while mixed.has_unfinished():
        for d in mixed.step():
            out[d.request_id] += d.new_token_ids
    assert [out[f"r{i}"] for i in range(len(ps))] == plain
    assert mixed.pool.num_used == 0


def test_prompt_lookup_accepts_on_repetitive_input():
    from tokenhaul.decoding.prompt_lookup import PromptLookup, lookup

    assert lookup([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 2) == [7, 5]  # the latest match of the 3-gram
    assert lookup([4, 4, 1, 2], 3) == []  # no 2-gram seen before
    core = core_with()
    core.decoder.proposers["prompt_lookup"] = PromptLookup(min_ngram=1)  # a random model rarely copies 2-grams
    core.observer = counter = SpecCounter()
    base = [5, 17, 33, 2, 71, 40, 9, 61]
    run_requests(core, [base * 6], greedy("prompt_lookup", max_tokens=32))
    assert counter.accepted > 0


def test_abort_mid_speculation_frees_every_block():
    core = core_with(draft=True)
    for i, p in enumerate(prompts(4)):
        core.add_request(f"r{i}", p, greedy(["draft", "jacobi", "prompt_lookup", "off"][i], max_tokens=40))
    for _ in range(4):
        core.step()
    assert core.pool.num_used > 0
    for i in range(4):
        core.abort(f"r{i}")
    assert core.pool.num_used == 0 and core.pool.num_free == core.pool.num_blocks
    assert not core.decoder._k


@pytest.mark.parametrize("spec", ["prompt_lookup", "draft"])
def test_preemption_with_drafts_keeps_output_and_frees_everything(spec):
    ps = prompts(6)
    plain = run_requests(core_with(num_kv_blocks=256), ps, greedy(max_tokens=20))
    core = core_with(draft=spec == "draft", num_kv_blocks=24)
    assert run_requests(core, ps, greedy(spec, max_tokens=20)) == plain
    assert core.scheduler.num_preemptions > 0
    assert core.pool.num_used == 0


@pytest.mark.parametrize("max_tokens, max_model_len", [(24, 512), (60, 32)])
def test_draft_request_that_fills_the_pool_finishes(max_tokens, max_model_len):
    """A request admitted with exactly the pool's 32 slots (prompt + max_tokens, or the context) finishes:
    the draft's lookahead reserves nothing past its last token (was: KV cache exhausted mid-way). The draft
    is the target itself, so every draft is accepted and k stays at 4 to the end."""
    cfg = EngineConfig(model="tiny", dtype="fp32", num_kv_blocks=8, block_size=4, max_model_len=max_model_len)
    core = EngineCore(cfg, tiny_model(), draft_model=tiny_model())
    core.add_request("short", [3, 4], greedy(max_tokens=3))
    core.add_request("long", prompts(1)[0][:8], greedy("draft", k=4, max_tokens=max_tokens))
    out, reasons = {"short": [], "long": []}, {}
    while core.has_unfinished():
        for d in core.step():
            out[d.request_id] += d.new_token_ids
            if d.finished:
                reasons[d.request_id] = d.finish_reason
    assert [len(out["short"]), len(out["long"])] == [3, 24]
    assert reasons == {"short": "length", "long": "length"}
    assert core.pool.num_used == 0


def test_draft_with_another_vocabulary_is_refused():
    from tokenhaul.errors import ModelError

    cfg = EngineConfig(model="tiny", dtype="fp32", num_kv_blocks=16, block_size=4)
    with pytest.raises(ModelError, match="vocabulary of 50 tokens, the target 97"):
        EngineCore(cfg, tiny_model(), draft_model=tiny_model(vocab_size=50))


def test_draft_request_without_draft_model_is_refused():
    from tokenhaul.errors import RequestError

    with pytest.raises(RequestError, match="draft model"):
        core_with().add_request("r", [1, 2, 3], greedy("draft"))


@pytest.mark.parametrize("spec", ["off", "prompt_lookup", "jacobi", "draft"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logit_bias_steers_every_strategy(spec, temperature):
    """logit_bias reaches every row that picks a token: plain decoding, verification, the draft model's own."""
    forced = SamplingParams(max_tokens=10, temperature=temperature, seed=5, ignore_eos=True, speculative=spec,
                            logit_bias={42: 100.0})
    assert run_requests(core_with(draft=spec == "draft"), prompts(3), forced) == [[42] * 10] * 3
    plain = run_requests(core_with(), prompts(3), greedy(max_tokens=10))
    banned = sorted({t for out in plain for t in out})[:5]
    params = SamplingParams(max_tokens=10, temperature=temperature, seed=5, ignore_eos=True, speculative=spec,
                            logit_bias={t: -100.0 for t in banned})
    outs = run_requests(core_with(draft=spec == "draft"), prompts(3), params)
    assert all(len(o) == 10 and not set(o) & set(banned) for o in outs)


def test_logit_bias_outside_the_vocabulary_is_refused():
    from tokenhaul.errors import RequestError

    core = core_with()
    with pytest.raises(RequestError, match=r"logit_bias contains token id 97, outside the vocabulary \[0, 97\)"):
        core.add_request("r", [1, 2, 3], SamplingParams(logit_bias={5: 1.0, 97: -1.0}))
    assert not core.has_unfinished()


def test_ledger_counts_drafts_per_request():
    from tokenhaul.ledger.costs import ModelCosts
    from tokenhaul.ledger.ledger import Ledger

    core = core_with(draft=True)
    led = core.observer = Ledger(ModelCosts.from_model(core.model, 4))
    ps = prompts(3)
    out = run_requests(core, ps, greedy("draft", max_tokens=16))
    spans = {s.request_id: s for s in led.requests}
    assert sum(s.proposed for s in spans.values()) == led.proposed_tokens > 0
    assert sum(s.rejected for s in spans.values()) == led.rejected_tokens > 0
    assert led.rejected_tokens == led.proposed_tokens - led.accepted_tokens
    assert all(s.rejected_bytes > 0 and s.rejected_s > 0 for s in spans.values() if s.rejected)
    assert led.prompt_tokens == sum(len(p) for p in ps)  # verify chunks are decode work, not prompt
    assert led.recomputed_tokens == 0  # rejected positions computed again are not "recomputed"
    assert sum(s.sampled for s in spans.values()) == sum(len(o) for o in out)


def test_packed_draft_with_dense_catch_up_keeps_greedy_output():
    """An int4 draft (bf16 activations) whose prompt catch-up runs through its dense copy into the same
    cache: the target's greedy output is unchanged and every block comes back."""
    import torch

    from tokenhaul.layers.quantization import LinearFactory, QuantSpec

    ps = prompts(4)
    plain = run_requests(core_with(), ps, greedy())
    packed = tiny_model(seed=0, make=LinearFactory(QuantSpec("int4", 32), torch.bfloat16))
    cfg = EngineConfig(model="tiny", dtype="fp32", num_kv_blocks=64, block_size=4)
    core = EngineCore(cfg, tiny_model(), draft_model=packed, draft_prefill_model=tiny_model(seed=0))
    core.observer = counter = SpecCounter()
    assert run_requests(core, ps, greedy("draft")) == plain
    assert counter.accepted > 0  # the draft is the target's own weights, int4-rounded: mostly right
    assert core.pool.num_used == 0


def test_draft_quantization_default_is_int4_under_bf16_only():
    from tokenhaul.errors import TokenhaulError

    assert EngineConfig(dtype="bf16").draft_quant == "int4"
    assert EngineConfig(dtype="fp32").draft_quant == "auto"  # as --quantization: the exact fp32 path
    assert EngineConfig(dtype="bf16", draft_quantization="none").draft_quant == "none"
    with pytest.raises(TokenhaulError, match="--draft-quantization: unknown quantization 'int3'"):
        EngineConfig(draft_quantization="int3")


class Oracle:
    """Drafts the known greedy continuation, so every draft is accepted: a proposer that is always right,
    to force a run of accepted drafts wherever the test wants one."""

    writes_kv = False

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def propose(self, reqs, ks):
        for r, k in zip(reqs, ks):
            r.draft_token_ids = self.tokens[r.num_tokens:r.num_tokens + k] if k > 0 else []
        return [None] * len(reqs)

    def observe(self, req, drafts, targets, accepted):
        pass

    def forget(self, request_id):
        pass


def _stop_case(proposer: str) -> tuple[list[int], list[int], list[int], int]:
    """(prompt, its greedy continuation, stop indices, drafts accepted in the run) for one proposer.

    oracle and draft: prompts(1)'s first prompt, 8 drafts accepted in the first speculative step (the oracle
    drafts the continuation; the draft model is the target itself). prompt_lookup, for real: a repeated base
    plus the tiny model's own first 23 greedy tokens after it (base found by searching prompts shaped as
    prompts()'s), where its text repeats itself: the lookup drafts the 6 tokens that followed the latest
    match of the last 3-gram and the target agrees with all 6. The random model does not copy the repeated
    base itself (it rarely continues a repeat), so prompts() alone gives no such run."""
    from tokenhaul.decoding.prompt_lookup import lookup

    if proposer == "prompt_lookup":
        base = [45, 17, 36, 17, 72, 4]
        start = base * 3 + base[:2]
        prompt = start + run_requests(core_with(), [start], greedy(max_tokens=23))[0]
    else:
        prompt = prompts(1)[0]
    plain = run_requests(core_with(), [prompt], greedy(max_tokens=24))[0]
    if proposer != "prompt_lookup":  # the first run: out[2:10] (the draft model starts a step late)
        return prompt, plain, [i for i in range(2, 7) if plain[i] not in plain[:i]], 8
    drafts = lookup(prompt + plain[:1], 8)  # the first run: out[1:7]
    run = next(i for i, (d, t) in enumerate(zip(drafts + [-1], plain[1:] + [-2])) if d != t)
    assert run == len(drafts) == 6, (drafts, plain)  # the case under test: a run the target accepts
    return prompt, plain, [i for i in range(1, run - 1) if plain[i] not in plain[:i]], run


@pytest.mark.parametrize("proposer", ["oracle", "draft", "prompt_lookup"])
@pytest.mark.parametrize("stop", ["stop_token", "eos"])
def test_a_stop_inside_a_run_of_accepted_drafts_ends_the_request_there(proposer, stop):
    """A stop token among accepted drafts, 2+ places before the run's end: the request ends at it (was: the
    positions past the stop counted as computed, and the prefix cache's register raised IndexError, aborting
    the batch). Only blocks of the request's own tokens are cached, and every block comes back.

    oracle: the Oracle above in the prompt_lookup slot (the name only picks the slot), drafting the known
    greedy continuation; draft: the real draft model (the target's own weights); prompt_lookup: the real
    n-gram lookup on a prompt whose continuation it drafts right (see _stop_case)."""
    from tokenhaul.kv.prefix_cache import chain_hashes

    prompt, plain, stops, run = _stop_case(proposer)
    assert len(stops) >= 2
    for i in stops:
        tok = plain[i]
        cfg = EngineConfig(model="tiny", dtype="fp32", num_kv_blocks=64, block_size=4)
        core = EngineCore(cfg, tiny_model(), draft_model=tiny_model() if proposer == "draft" else None)
        if proposer == "oracle":
            core.decoder.proposers["prompt_lookup"] = Oracle(prompt + plain)
        core.observer = counter = SpecCounter()
        params = SamplingParams(max_tokens=24, temperature=0, num_speculative_tokens=8,
                                speculative="draft" if proposer == "draft" else "prompt_lookup",
                                stop_token_ids=[tok] if stop == "stop_token" else [])
        core.add_request("r", prompt, params, (tok,) if stop == "eos" else ())
        out, reason = [], None
        while core.has_unfinished():
            for d in core.step():
                out += d.new_token_ids
                reason = d.finish_reason if d.finished else reason
        assert out == plain[:i + 1] and reason == "stop"
        assert counter.accepted == counter.proposed == run  # one step, the stop inside its run of accepted drafts
        assert core.pool.num_used == 0
        own = set(chain_hashes(prompt + out, 4, []))
        assert {h for h, _ in core.prefix_cache._content.values()} <= own
