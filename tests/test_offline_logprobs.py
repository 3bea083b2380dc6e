"""The offline API's logprobs in vLLM's shapes (vllm.outputs / vllm.logprobs): CompletionOutput.logprobs is one
dict per generated token, token id -> Logprob(logprob, rank, decoded_token), holding the sampled token and the
top k; RequestOutput.prompt_logprobs is None for the first prompt token, then one such dict per prompt token.
Code ported from vLLM reads `out.outputs[0].logprobs[i][token_id].logprob`. On the real smollm2-135m."""

import pytest

import tokenhaul
from tokenhaul.sampling_params import SamplingParams

pytestmark = pytest.mark.real_model

PROMPT = "The capital of France is"


def text_of(llm, token_id: int) -> str:
    return llm.tokenizer.decode([token_id], skip_special_tokens=False)


def check_dict(llm, d: dict, token_id: int, k: int) -> None:
    """One position's dict: the token itself and the k most likely (ranks 1..k), each with its own text."""
    assert isinstance(d, dict) and token_id in d
    assert all(isinstance(v, tokenhaul.Logprob) for v in d.values())
    assert len(d) in (k, k + 1) if k else len(d) == 1
    top = sorted((v.rank, tid) for tid, v in d.items() if v.rank <= k)
    assert [r for r, _ in top] == list(range(1, k + 1))
    values = [d[tid].logprob for _, tid in top]
    assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
    assert d[token_id].rank >= 1 and (len(d) == k) == (d[token_id].rank <= k)
    assert d[token_id].rank == 1 + sum(v.logprob > d[token_id].logprob for v in d.values()) or d[token_id].rank > k
    for tid, v in d.items():
        assert v.decoded_token == text_of(llm, tid)


def test_generate_logprobs_and_prompt_logprobs_are_vllm_dicts(smollm):
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=11, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    out = smollm.generate(PROMPT, params)[0]
    c = out.outputs[0]
    assert len(c.logprobs) == len(c.token_ids) == 8
    for d, t in zip(c.logprobs, c.token_ids):
        check_dict(smollm, d, t, 3)
    assert c.cumulative_logprob == pytest.approx(sum(d[t].logprob for d, t in zip(c.logprobs, c.token_ids)))
    assert out.logprobs == c.logprobs  # the request's own fields are outputs[0]'s
    pl = out.prompt_logprobs
    assert pl[0] is None and len(pl) == len(out.prompt_token_ids)
    for d, t in zip(pl[1:], out.prompt_token_ids[1:]):
        check_dict(smollm, d, t, 2)


def test_greedy_token_ranks_first_and_logprobs_zero_holds_only_the_token(smollm):
    """Greedy: the sampled token is rank 1, its dict's best; logprobs=0 (vLLM's): only the sampled token, ranked."""
    greedy = smollm.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0, logprobs=2))[0].outputs[0]
    for d, t in zip(greedy.logprobs, greedy.token_ids):
        assert d[t].rank == 1 and next(iter(d)) == t and d[t].logprob == max(v.logprob for v in d.values())
    zero = smollm.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0, logprobs=0))[0].outputs[0]
    assert zero.token_ids == greedy.token_ids
    for d, g, t in zip(zero.logprobs, greedy.logprobs, zero.token_ids):
        assert list(d) == [t] and d[t] == g[t]
    none = smollm.generate(PROMPT, SamplingParams(max_tokens=2, temperature=0))[0]
    assert none.outputs[0].logprobs is None and none.logprobs is None and none.prompt_logprobs is None


def test_chat_and_n_samples_logprobs_are_vllm_dicts(smollm):
    out = smollm.chat([{"role": "user", "content": "Hi"}],
                      SamplingParams(n=2, max_tokens=3, temperature=1.0, seed=5, logprobs=1))[0]
    assert len(out.outputs) == 2
    for c in out.outputs:
        assert len(c.logprobs) == len(c.token_ids)
        for d, t in zip(c.logprobs, c.token_ids):
            check_dict(smollm, d, t, 1)
        assert c.cumulative_logprob == pytest.approx(sum(d[t].logprob for d, t in zip(c.logprobs, c.token_ids)))


def test_logprob_is_vllms():
    lp = tokenhaul.Logprob(-0.5)
    assert (lp.logprob, lp.rank, lp.decoded_token) == (-0.5, None, None)
    assert tokenhaul.Logprob(-1.0, 2, "a") == tokenhaul.Logprob(logprob=-1.0, rank=2, decoded_token="a")
