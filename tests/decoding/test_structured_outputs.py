"""Structured outputs (llguidance) on a tiny random model with a 97-token byte-level tokenizer: every output
follows its constraint, greedy takes the masked argmax, unconstrained neighbours in the batch are unchanged bit
for bit, preemption feeds no token twice, and what cannot work is refused with one line."""

import re

import pytest
import torch
from tiny_models import tiny_model
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from tokenhaul.config import EngineConfig
from tokenhaul.decoding.grammar import Grammar, GrammarCompiler
from tokenhaul.decoding.sampler import sample
from tokenhaul.engine.core import EngineCore
from tokenhaul.engine.request import Request
from tokenhaul.errors import RequestError
from tokenhaul.sampling_params import SamplingParams, StructuredOutputsParams

EOS = 0
PROMPTS = [[5, 17, 33, 40, 2, 9], [60, 61, 3], [44, 12, 80, 81, 82, 7, 7, 30]]


def tiny_tokenizer() -> Tokenizer:
    """<eos> = 0, then one token per printable ASCII character (space as byte-level 'Ġ') = 1..95, "yes" = 96."""
    vocab = {"<eos>": EOS} | {("Ġ" if c == 32 else chr(c)): c - 31 for c in range(32, 127)} | {"yes": 96}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<eos>", special=True)])
    return tok


TOKENIZER = tiny_tokenizer()
GRAMMARS = GrammarCompiler(lambda: (TOKENIZER.to_str(), [EOS]), 97)


def text(ids: list[int]) -> str:
    return TOKENIZER.decode([t for t in ids if t != EOS])


def make_core(**kw) -> EngineCore:
    cfg = EngineConfig(model="tiny", dtype="fp32", **({"num_kv_blocks": 64, "block_size": 4} | kw))
    return EngineCore(cfg, tiny_model(), grammars=GRAMMARS)


def run(core: EngineCore, jobs: list[tuple[list[int], SamplingParams]]) -> dict[str, tuple[list[int], str, list]]:
    """jobs → {id: (tokens, finish reason, samples)}."""
    for i, (prompt, params) in enumerate(jobs):
        core.add_request(f"r{i}", prompt, params, (EOS,))
    out = {f"r{i}": ([], None, []) for i in range(len(jobs))}
    while core.has_unfinished():
        for d in core.step():
            toks, _, samples = out[d.request_id]
            out[d.request_id] = (toks + d.new_token_ids, d.finish_reason, samples + d.samples)
    return out


def so(**kw) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kw)


CHOICES = ["yes", "no", "maybe not"]
SETTINGS = [dict(temperature=0), dict(temperature=1.0, seed=7), dict(temperature=1.5, top_k=20, seed=3)]


@pytest.mark.parametrize("kw", SETTINGS)
def test_choice_outputs_are_one_of_the_choices(kw):
    params = SamplingParams(max_tokens=20, structured_outputs=so(choice=CHOICES), **kw)
    out = run(make_core(), [(p, params) for p in PROMPTS])
    for toks, reason, _ in out.values():
        assert text(toks) in CHOICES and reason == "stop"


@pytest.mark.parametrize("kw", SETTINGS)
def test_regex_outputs_match(kw):
    pattern = r"[a-c]{2,4}-[0-9]{3}"
    params = SamplingParams(max_tokens=20, structured_outputs=so(regex=pattern), **kw)
    out = run(make_core(), [(p, params) for p in PROMPTS])
    for toks, reason, _ in out.values():
        assert re.fullmatch(pattern, text(toks)) and reason == "stop"


def test_unconstrained_neighbours_are_unchanged_bit_for_bit():
    plain = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=3),
             SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True, logprobs=2)]
    free = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)  # lives as long as the constrained one
    constrained = SamplingParams(max_tokens=10, temperature=0, structured_outputs=so(regex="[x-z]{6}"))
    ref = run(make_core(), [(PROMPTS[0], plain[0]), (PROMPTS[2], free), (PROMPTS[1], plain[1])])
    mixed = run(make_core(), [(PROMPTS[0], plain[0]), (PROMPTS[2], constrained), (PROMPTS[1], plain[1])])
    assert re.fullmatch("[x-z]{6}", text(mixed["r1"][0])) and text(ref["r1"][0]) != text(mixed["r1"][0])
    for r in ("r0", "r2"):
        assert ref[r][0] == mixed[r][0] and len(ref[r][0]) == 10
        assert [(s.logprob, s.top_logprobs) for s in ref[r][2]] == [(s.logprob, s.top_logprobs) for s in mixed[r][2]]


def test_masked_greedy_is_the_argmax_over_the_allowed_tokens():
    g = torch.Generator().manual_seed(0)
    allowed = [ord("y") - 31, ord("n") - 31, ord("m") - 31, 96]  # the first token of "yes", "no", "maybe not"
    outside = 0
    for _ in range(20):
        logits = torch.randn(1, 97, generator=g)
        req = Request("r", [1], SamplingParams(temperature=0, logprobs=2, structured_outputs=so(choice=CHOICES)),
                      (EOS,), grammar=GRAMMARS.compile(so(choice=CHOICES)))
        s = sample(logits.clone(), [req])[0]
        best = max(allowed, key=lambda t: logits[0, t].item())
        assert s.token == best
        outside += logits.argmax().item() not in allowed
        lp = torch.log_softmax(logits[0, allowed], -1)  # as vLLM: logprobs of the masked distribution
        assert s.logprob == pytest.approx(lp[allowed.index(best)].item(), abs=1e-6)
        assert {t for t, _ in s.top_logprobs} <= set(allowed)
    assert outside > 15  # the unmasked argmax was mostly elsewhere


def test_eos_only_where_the_grammar_accepts():
    logits = torch.zeros(1, 97)
    logits[0, EOS] = 50.0  # the model wants to stop at once
    req = Request("r", [1], SamplingParams(temperature=0, structured_outputs=so(regex="[a-c]+")), (EOS,),
                  grammar=GRAMMARS.compile(so(regex="[a-c]+")))
    first = sample(logits.clone(), [req])[0].token
    assert first in {ord(c) - 31 for c in "abc"}
    req.grammar.accept(first)
    assert sample(logits.clone(), [req])[0].token == EOS  # "a" is complete: EOS is allowed now


def test_a_refused_token_aborts_the_request(monkeypatch):
    """A token the matcher refuses (here: a mask broken on purpose lets any token through) ends the request as
    "abort", not "stop": its output no longer meets the constraint."""
    monkeypatch.setattr(Grammar, "fill_bitmask", lambda self, row: row.fill_(-1))
    params = SamplingParams(max_tokens=20, temperature=0, structured_outputs=so(regex="q{20}"))
    out = run(make_core(), [(p, params) for p in PROMPTS])
    for toks, reason, _ in out.values():
        assert reason == "abort" and text(toks) != "q" * 20


def test_preemption_feeds_no_token_twice():
    pattern = r"(ab|cd){4}"
    params = SamplingParams(max_tokens=30, temperature=0, structured_outputs=so(regex=pattern))
    jobs = [(p * 3, params) for p in PROMPTS]
    roomy = run(make_core(), jobs)
    tight = make_core(num_kv_blocks=14)
    out = run(tight, jobs)
    assert tight.scheduler.num_preemptions > 0
    assert {k: v[0] for k, v in out.items()} == {k: v[0] for k, v in roomy.items()}
    assert all(re.fullmatch(pattern, text(v[0])) for v in out.values())


def test_compiled_argmax_is_not_taken_for_constrained_requests():
    core = make_core()
    core.add_request("r", PROMPTS[0], SamplingParams(temperature=0, structured_outputs=so(choice=["zz"])), (EOS,))
    sched = core.scheduler.schedule()
    logits = core.runner.forward(core.runner.prepare(sched))
    wrong_top = torch.tensor([ord("a") - 31])  # what an argmax over the unmasked row might say
    verdict = core.decoder.verify(logits, sched.chunks, wrong_top)[0]
    assert verdict.samples[0].token == ord("z") - 31


@pytest.mark.parametrize("kw, words", [
    (dict(json="{not json"), "not valid JSON"),
    (dict(json={"type": "foo"}), "json is invalid"),
    (dict(regex="[a-z"), "regex is invalid"),
    (dict(choice=[]), "choice"),
    (dict(grammar="start: ("), "grammar is invalid"),
    (dict(regex="a", choice=["a"]), "exactly one of"),
    (dict(), "exactly one of"),
])
def test_malformed_constraints_are_refused_in_one_line(kw, words):
    with pytest.raises(RequestError, match=words) as e:
        SamplingParams(structured_outputs=so(**kw))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kw", [dict(speculative="prompt_lookup"), dict(speculative="jacobi"),
                                dict(use_beam_search=True, temperature=0)])
def test_speculation_and_beams_are_refused(kw):
    with pytest.raises(RequestError, match="structured_outputs does not combine"):
        SamplingParams(structured_outputs=so(regex="a+"), **kw)


def test_dict_form_and_unknown_keys():
    assert SamplingParams(structured_outputs={"choice": ["a", "b"]}).structured_outputs.kind == "choice"
    with pytest.raises(RequestError, match="does not take bogus"):
        SamplingParams(structured_outputs={"regex": "a", "bogus": 1})
