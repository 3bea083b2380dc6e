"""LLM.generate's RequestOutput.outputs (vLLM's): n > 1 samples fanned out into n engine requests seeded
seed + i (as the HTTP server seeds its choices) and folded back per prompt; one entry per n = 1 request;
one per returned beam. All on the real smollm2-135m, a few tokens each."""

from dataclasses import replace

import pytest

from tokenhaul.errors import RequestError
from tokenhaul.kv.manager import KVHolder
from tokenhaul.sampling_params import SamplingParams
from tokenhaul.server.completion_protocol import CompletionRequest

pytestmark = pytest.mark.real_model

STORY, FRANCE = "Once upon a time", "The capital of France is"
SAMPLED = SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=7, ignore_eos=True)


def fields(o) -> tuple:
    return o.text, o.token_ids, o.finish_reason, o.stop_reason, o.logprobs


def test_n_samples_are_the_seeded_single_requests_in_prompt_order(smollm):
    """Sample i of n=3 equals an n=1 request seeded seed + i, token for token (the server's choice seeds);
    the other prompt of the call keeps its place and its single output."""
    story, france = smollm.generate([STORY, FRANCE], [SAMPLED, SamplingParams(max_tokens=3, temperature=0)])
    assert story.prompt_token_ids == smollm.encode(STORY) and france.prompt_token_ids == smollm.encode(FRANCE)
    assert [c.index for c in story.outputs] == [0, 1, 2]
    seeds = [p.seed for p in CompletionRequest(prompt=STORY, n=3, seed=7).choice_params(5, None)]
    assert seeds == [7, 8, 9]
    for c, seed in zip(story.outputs, seeds):
        alone = smollm.generate(STORY, replace(SAMPLED, n=1, seed=seed))[0]
        assert (c.text, c.token_ids, c.finish_reason) == (alone.text, alone.token_ids, "length")
        assert len(c.token_ids) == 5 and c.cumulative_logprob is None and c.logprobs is None
    assert len({tuple(c.token_ids) for c in story.outputs}) == 3  # the seeds differ, so do the samples
    assert fields(story) == fields(story.outputs[0])
    assert len(france.outputs) == 1 and fields(france) == fields(france.outputs[0])


def test_outputs_zero_mirrors_the_request_with_logprobs(smollm):
    """outputs[0] is the request's own text, ids, reasons and logprobs; cumulative_logprob their sum."""
    for n in (1, 2):
        out = smollm.generate(FRANCE, SamplingParams(n=n, max_tokens=3, temperature=0.8, seed=3, logprobs=1))[0]
        assert len(out.outputs) == n and fields(out) == fields(out.outputs[0])
        for c in out.outputs:
            assert len(c.logprobs) == len(c.token_ids) == 3
            total = sum(d[t].logprob for d, t in zip(c.logprobs, c.token_ids))  # vLLM's dicts: id -> Logprob
            assert c.cumulative_logprob == pytest.approx(total) != 0


def test_greedy_n_gives_n_identical_greedy_outputs(smollm):
    greedy = SamplingParams(max_tokens=4, temperature=0)
    out = smollm.generate(FRANCE, replace(greedy, n=2))[0]
    alone = smollm.generate(FRANCE, greedy)[0]
    assert [c.index for c in out.outputs] == [0, 1]
    assert [c.token_ids for c in out.outputs] == [alone.token_ids] * 2 and out.token_ids == alone.token_ids


def test_beam_outputs_are_the_beams_with_their_own_finish_reason(smollm):
    """One output per returned beam, best first: its tokens and text; 'stop' with the stop_token_ids id it
    ended at, else 'length' (here the best beam stops at '.', the others run to max_tokens)."""
    p = SamplingParams(max_tokens=3, use_beam_search=True, beam_width=4, n=3, stop_token_ids=[30])
    out = smollm.generate(FRANCE, p)[0]
    assert [(c.index, c.token_ids, c.text) for c in out.outputs] == [(k, b.token_ids, b.text)
                                                                     for k, b in enumerate(out.beams)]
    reasons = [(c.finish_reason, c.stop_reason) for c in out.outputs]
    assert reasons == [("stop", 30) if c.token_ids[-1] == 30 else ("length", None) for c in out.outputs]
    assert {"stop", "length"} <= {r for r, _ in reasons}
    assert fields(out) == fields(out.outputs[0])
    for c, b in zip(out.outputs, out.beams):  # the sum of logprobs, which the score divides by length
        assert c.cumulative_logprob == pytest.approx(b.score * len(b.token_ids))


def test_a_width_one_beams_cumulative_logprob_is_the_greedy_sum(smollm):
    beam = smollm.generate(FRANCE, SamplingParams(max_tokens=4, use_beam_search=True, beam_width=1, n=1,
                                                  length_penalty=0.5))[0]
    greedy = smollm.generate(FRANCE, SamplingParams(max_tokens=4, temperature=0, logprobs=0))[0]
    assert beam.token_ids == greedy.token_ids
    assert beam.outputs[0].cumulative_logprob == pytest.approx(greedy.outputs[0].cumulative_logprob, abs=1e-4)


def test_the_ledger_covers_every_sample(smollm):
    outs = smollm.generate([STORY, FRANCE], SAMPLED)
    ledger = outs[0].ledger
    assert outs[1].ledger is ledger and len(ledger.requests) == 6
    assert sum(s.tokens for s in ledger.requests) == sum(len(c.token_ids) for o in outs for c in o.outputs) == 30


def test_bad_n_is_refused(smollm):
    for bad in (0, 129, 2.0):
        with pytest.raises(RequestError, match="n must be"):
            smollm.generate(STORY, SamplingParams(n=bad))
    with pytest.raises(RequestError, match="keep_kv"):  # n samples cannot all keep their KV in one holder
        smollm.generate([FRANCE, STORY], SAMPLED, keep_kv=[None, KVHolder()])
    assert not smollm.core.has_unfinished() and smollm.core.pool.num_used == 0  # the first prompt's samples too


def test_prompt_logprobs_are_computed_once_for_n_samples(smollm):
    """The n samples share one prompt: only sample 0 asks for its prompt logprobs (the ledger's extra lm_head
    rows are one prompt's), and they equal a single request's."""
    p = replace(SAMPLED, prompt_logprobs=1)
    out = smollm.generate(FRANCE, p)[0]
    single = smollm.generate(FRANCE, replace(p, n=1))[0]
    assert len(out.outputs) == 3 and out.prompt_logprobs == single.prompt_logprobs
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids) and out.prompt_logprobs[0] is None
    assert sum(s.record.prompt_logprob_rows for s in out.ledger.steps) == len(out.prompt_token_ids) - 1


def test_vllm_accessors(smollm):
    """out.prompt is the prompt's text (None for token ids); llm.get_tokenizer() the model's tokenizer."""
    text, ids = smollm.generate([FRANCE, [1, 2, 3]], SamplingParams(max_tokens=1))
    assert text.prompt == FRANCE and ids.prompt is None
    assert smollm.get_tokenizer().encode(FRANCE) == text.prompt_token_ids
    chat = smollm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=1))[0]
    assert chat.prompt.endswith("Hi<|im_end|>\n<|im_start|>assistant\n")  # the rendered chat


def test_use_tqdm_counts_every_request(smollm, capsys):
    """vLLM's use_tqdm: a bar of finished engine requests on stderr (the n samples each count); off by default."""
    smollm.generate([STORY, FRANCE], SAMPLED, use_tqdm=True)
    err = capsys.readouterr().err
    assert "generate" in err and "6/6" in err
    smollm.generate(STORY, replace(SAMPLED, n=1))
    assert capsys.readouterr().err == ""
