import pytest
import torch

from tokenhaul.decoding.sampler import SamplingBatch, adjust_logits, filter_logits, sample
from tokenhaul.engine.request import Request
from tokenhaul.errors import RequestError
from tokenhaul.sampling_params import SamplingParams

LOGITS = torch.tensor([1.0, 3.0, 2.0, 0.5, 2.9])


def req(prompt=(1,), out=(), **kw):
    r = Request("r", list(prompt), SamplingParams(**kw))
    r.output_token_ids = list(out)
    return r


def draw(params: dict, n=300, logits=LOGITS):
    r = req(**params)
    return [sample(logits[None].clone(), [r])[0].token for _ in range(n)]


def test_greedy_is_argmax():
    assert draw({"temperature": 0}, 3) == [1, 1, 1]


def test_top_k_top_p_min_p_restrict_support():
    assert set(draw({"top_k": 2})) == {1, 4}
    assert set(draw({"top_p": 0.01})) == {1}
    assert set(draw({"min_p": 0.9})) == {1, 4}  # p(4) / p(1) = e^-0.1 ≈ 0.905
    assert set(draw({"min_p": 0.95})) == {1}
    assert set(draw({"top_k": 0})) == {0, 1, 2, 3, 4}


def filt(logits, top_k, top_p, min_p):
    """One row through the batched filter."""
    V = logits.shape[-1]
    return filter_logits(logits[None], torch.tensor([top_k or V]), torch.tensor([top_p]), torch.tensor([min_p]))[0]


def penalize(logits, r):
    return adjust_logits(logits[None], SamplingBatch.build([r], logits.shape[-1]))[0]


def test_filter_logits_min_p_exact():
    out = filt(LOGITS.clone(), 0, 1.0, 0.5)
    probs = torch.softmax(LOGITS, -1)
    assert torch.equal(torch.isinf(out), probs < 0.5 * probs.max())


def test_top_p_keeps_token_that_crosses_threshold():
    probs = torch.softmax(LOGITS, -1)
    top = probs.max().item()
    out = filt(LOGITS.clone(), 0, top + 1e-4, 0.0)
    assert (~torch.isinf(out)).sum() == 2


def test_seed_reproducible_and_distinct():
    r1, r2 = req(seed=7), req(seed=7)
    s1 = [sample(LOGITS[None].clone(), [r1])[0].token for _ in range(40)]
    s2 = [sample(LOGITS[None].clone(), [r2])[0].token for _ in range(40)]
    assert s1 == s2
    r3 = req(seed=8)
    assert s1 != [sample(LOGITS[None].clone(), [r3])[0].token for _ in range(40)]


def test_temperature_sharpens():
    cold = draw({"temperature": 0.05}, 200)
    assert cold.count(1) > 150


def test_repetition_penalty():
    r = req(prompt=(1,), out=(3,), repetition_penalty=2.0)
    out = penalize(LOGITS.clone(), r)
    assert out[1] == pytest.approx(1.5) and out[3] == pytest.approx(0.25) and out[2] == 2.0


def test_presence_and_frequency_penalty():
    r = req(out=(2, 2, 0), presence_penalty=0.5, frequency_penalty=0.25)
    out = penalize(LOGITS.clone(), r)
    assert out[2] == pytest.approx(2.0 - 0.5 - 0.5) and out[0] == pytest.approx(1.0 - 0.5 - 0.25)
    assert out[1] == 3.0


def test_logprobs_chosen_and_top_n():
    s = sample(LOGITS[None].clone(), [req(temperature=0, logprobs=3)])[0]
    lp = torch.log_softmax(LOGITS, -1)
    assert s.logprob == pytest.approx(lp[1].item())
    assert [t for t, _ in s.top_logprobs] == [1, 4, 2]
    assert s.top_logprobs[0][1] == pytest.approx(lp[1].item())


def test_batched_rows_equal_rows_alone():
    """Mixed parameters in one batch: each row filtered and penalised exactly as when alone."""
    g = torch.Generator().manual_seed(0)
    rs = [req(top_k=3), req(top_p=0.4, out=(1, 1, 2), presence_penalty=0.3), req(min_p=0.2, temperature=0.5),
          req(repetition_penalty=1.5, prompt=(4, 5), frequency_penalty=0.5, out=(4,)), req(temperature=0),
          req(logit_bias={7: 3.0, 40: -2.5}, presence_penalty=0.5, out=(7,)), req(temperature=0, logit_bias={2: 1.0})]
    logits = torch.randn(len(rs), 50, generator=g)
    batch = SamplingBatch.build(rs, 50)
    before = logits.clone()
    together = filter_logits(adjust_logits(logits, batch), batch.top_k, batch.top_p, batch.min_p)
    for i, r in enumerate(rs):
        alone = SamplingBatch.build([r], 50)
        row = filter_logits(adjust_logits(logits[i:i + 1], alone), alone.top_k, alone.top_p, alone.min_p)
        assert torch.equal(together[i], row[0])
    assert torch.isinf(together[0]).sum() == 47
    assert together[5, 7] == pytest.approx(before[5, 7] + 3.0 - 0.5) and together[6, 2] == before[6, 2] + 1.0
    assert torch.equal(logits, before)  # the caller's logits (logprobs are read from them) are left alone


def test_seeded_rows_do_not_depend_on_batch_neighbours():
    rows = torch.stack([LOGITS.flip(0), LOGITS, LOGITS.flip(0)])
    r1, r2 = req(seed=11), req(seed=11)
    alone = [sample(LOGITS[None].clone(), [r1])[0].token for _ in range(30)]
    mixed = [sample(rows, [req(), r2, req(temperature=2.0)])[1].token for _ in range(30)]
    assert alone == mixed and len(set(alone)) > 1


def test_batch_rows_sampled_independently():
    logits = torch.stack([LOGITS, LOGITS.flip(0)])
    out = sample(logits, [req(temperature=0), req(temperature=0)])
    assert [o.token for o in out] == [1, 3]


@pytest.mark.parametrize("kw,msg", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -3}, "max_tokens"), ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"), ({"temperature": -1}, "temperature"), ({"min_p": 2}, "min_p"),
    ({"top_k": -5}, "top_k"), ({"repetition_penalty": 0}, "repetition_penalty"), ({"logprobs": 50}, "logprobs"),
    ({"logit_bias": {5: 101}}, "logit_bias"), ({"logit_bias": {5: -100.5}}, "logit_bias"),
    ({"logit_bias": {5: float("nan")}}, "logit_bias"), ({"logit_bias": {5: float("inf")}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"), ({"logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"logit_bias": {5: "1"}}, "logit_bias"), ({"logit_bias": {True: 1.0}}, "logit_bias"),
    ({"logit_bias": [(5, 1.0)]}, "logit_bias"),
    # the wrong types, refused here rather than crashing inside the sampler's or the scheduler's tensor code
    ({"top_k": 2.5}, "top_k"), ({"top_k": True}, "top_k"), ({"top_k": None}, "top_k"), ({"logprobs": 2.5}, "logprobs"),
    ({"logprobs": True}, "logprobs"), ({"seed": 2.5}, "seed"), ({"seed": "7"}, "seed"), ({"seed": 2**64}, "seed"),
    ({"stop_token_ids": 5}, "stop_token_ids"), ({"stop_token_ids": [5.5]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"stop": [3]}, "stop"), ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": 2.0}, "max_tokens"), ({"temperature": None}, "finite"), ({"top_p": "0.9"}, "finite"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"), ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": 2.5}, "prompt_logprobs"), ({"prompt_logprobs": True}, "prompt_logprobs"),
    ({"prompt_logprobs": "1"}, "prompt_logprobs"),
    ({"use_beam_search": True, "temperature": 0, "prompt_logprobs": 1}, "prompt_logprobs"),
])
def test_bad_params_one_line_errors(kw, msg):
    with pytest.raises(RequestError, match=msg) as e:
        SamplingParams(**kw)
    assert "\n" not in str(e.value)


def test_none_stop_and_stop_token_ids_mean_none():
    """vLLM's SamplingParams takes None for stop and stop_token_ids: no stops (the scheduler iterates them)."""
    p = SamplingParams(stop=None, stop_token_ids=None)
    assert p.stop == [] and p.stop_token_ids == []


def test_argmax_matches_torch_including_ties():
    """The CPU fast path (numpy) picks the same index as torch: the first of equal maxima."""
    from tokenhaul.decoding.sampler import argmax

    x = torch.randn(5, 1000)
    x[1, 7] = x[1, 900] = 50.0  # a tie: the first wins
    x[2] = 0.0
    assert torch.equal(argmax(x), x.argmax(-1)) and argmax(x)[1] == 7 and argmax(x)[2] == 0
    assert torch.equal(argmax(x.t().contiguous().t()), x.argmax(-1))  # non-contiguous: torch's own


def test_logit_bias_moves_greedy():
    """Greedy is the argmax of the biased logits: -100 moves it off the raw argmax, +100 forces a token."""
    assert draw({"temperature": 0, "logit_bias": {1: -100}}, 2) == [4, 4]
    assert draw({"temperature": 0, "logit_bias": {3: 100}}, 2) == [3, 3]
    assert draw({"temperature": 0, "logit_bias": {1: -0.05}}, 1) == [1]  # 2.95 still beats 2.9
    assert draw({"temperature": 0, "logit_bias": {4: 0.06, 1: -0.06}}, 1) == [4]  # several ids in one row
    assert draw({"temperature": 0, "logit_bias": {1: 0, 3: 0}}, 1) == [1]  # zero biases change nothing


def test_logit_bias_when_sampling():
    assert set(draw({"logit_bias": {3: 100}}, 100)) == {3}
    assert set(draw({"temperature": 1.5, "top_p": 0.7, "logit_bias": {1: -100, 4: -100}}, 200)) == {0, 2}
    assert set(draw({"top_k": 1, "logit_bias": {0: 2.5}})) == {0}  # top-k sees the biased logits (3.5 > 3)


def test_logit_bias_keeps_raw_logprobs():
    """Reported logprobs are the model's raw distribution's, whatever was added before sampling (vLLM's rule)."""
    lp = torch.log_softmax(LOGITS, -1)
    for kw in ({"temperature": 0}, {"temperature": 0.7, "seed": 3}):
        s = sample(LOGITS[None].clone(), [req(logprobs=2, logit_bias={3: 100}, **kw)])[0]
        assert s.token == 3 and s.logprob == pytest.approx(lp[3].item())
        assert [t for t, _ in s.top_logprobs] == [1, 4] and s.top_logprobs[0][1] == pytest.approx(lp[1].item())


def test_logit_bias_before_penalties():
    """vLLM v1's order: bias, then the repetition penalty divides the biased logit (0.5 + 1) / 2, not 0.5 / 2 + 1."""
    out = penalize(LOGITS.clone(), req(out=(3,), repetition_penalty=2.0, logit_bias={3: 1.0, 0: -1.0}))
    assert out[3] == pytest.approx(0.75) and out[0] == pytest.approx(0.0) and out[2] == 2.0


def test_sampled_token_rank_among_the_vocabulary():
    """Each sampled token's rank (vLLM's: the tokens at least as likely, itself included), with its logprob; the
    CPU's numpy count and torch's compare-and-sum (other devices) agree."""
    from tokenhaul.decoding.sampler import token_ranks

    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5, 2.9], [0.0, 0.0, 1.0, 0.0, -1.0]])
    s = sample(logits.clone(), [req(temperature=0, logprobs=2), req(temperature=0, logit_bias={4: 10.0}, logprobs=0)])
    assert (s[0].token, s[0].rank) == (1, 1) and (s[1].token, s[1].rank) == (4, 5)  # raw logprobs: 4 is the last
    assert sample(logits[:1].clone(), [req(temperature=0)])[0].rank is None  # no logprobs asked: none paid
    lp = torch.log_softmax(logits, -1)
    assert token_ranks(lp, [3, 1]) == [5, 4] == token_ranks(lp.t().contiguous().t(), [3, 1])  # ties count in
