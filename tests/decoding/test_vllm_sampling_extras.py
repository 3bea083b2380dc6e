"""vLLM's SamplingParams extras: allowed_token_ids (only those tokens may be sampled) and bad_words (a word's last
token is banned wherever the output so far ends with the rest of it), greedy, sampled and speculative;
truncate_prompt_tokens, detokenize=False, clone(), and the prompt dicts LLM.generate takes."""

import pytest
import torch
from drive import run_requests

from tokenhaul.decoding.sampler import sample
from tokenhaul.engine.messages import CoreLimits
from tokenhaul.engine.request import Request
from tokenhaul.errors import RequestError
from tokenhaul.sampling_params import SamplingParams

LOGITS = torch.tensor([1.0, 3.0, 2.0, 0.5, 2.9])
PROMPT = [5, 6, 7, 8]


def tokens(out=(), n=50, **kw) -> set[int]:
    r = Request("r", [0], SamplingParams(**kw))
    r.output_token_ids = list(out)
    return {sample(LOGITS[None].clone(), [r])[0].token for _ in range(n)}


def bad(seqs, **kw) -> SamplingParams:
    p = SamplingParams(bad_words=["x"] * len(seqs), **kw)
    p.bad_words_token_ids = seqs
    return p


def test_allowed_token_ids_mask_every_other_token():
    assert tokens(temperature=0, allowed_token_ids=[0, 3]) == {0}
    assert tokens(temperature=1.5, seed=2, allowed_token_ids=[3, 4], n=200) == {3, 4}
    r = Request("r", [0], SamplingParams(temperature=0, logprobs=1, allowed_token_ids=[2]))
    s = sample(LOGITS[None].clone(), [r])[0]
    assert s.token == 2 and s.logprob == pytest.approx(torch.log_softmax(LOGITS, -1)[2].item())  # raw logprobs


def test_bad_words_ban_the_last_token_after_the_rest():
    r = Request("r", [0], bad([[1]], temperature=0))
    assert sample(LOGITS[None].clone(), [r])[0].token == 4  # a one-token word: never
    p = bad([[2, 4], [3, 1]], temperature=0)
    for out, want in (([], 1), ([2], 1), ([0, 3], 4), ([3, 3], 4), ([1], 1)):
        r = Request("r", [0], p)
        r.output_token_ids = list(out)
        assert sample(LOGITS[None].clone(), [r])[0].token == want, out


def test_bad_words_tokenized_with_and_without_a_leading_space():
    vocab = {"foo": [7], " foo": [9], "foo bar": [7, 3], " foo bar": [9, 3], "zz": [5, 5], " zz": [6]}
    p = SamplingParams(bad_words=[" foo", "foo bar", "zz"])
    p.update_from_tokenizer(vocab.__getitem__)
    assert p.bad_words_token_ids == [[7], [9], [7, 3], [9, 3], [5, 5], [6]]  # " zz": one token (vLLM skips it)


def test_core_refuses_untokenized_bad_words_and_ids_outside_the_vocabulary():
    limits = CoreLimits(max_model_len=64, block_size=16, num_blocks=8, vocab_size=10)
    for params, what in ((SamplingParams(bad_words=["no"]), "tokenized"), (bad([[3, 12]]), "bad_words"),
                         (SamplingParams(allowed_token_ids=[1, 10]), "allowed_token_ids")):
        with pytest.raises(RequestError, match=what):
            limits.check_params(params)


@pytest.mark.parametrize("spec", ["off", "prompt_lookup", "jacobi"])
def test_engine_never_emits_a_banned_word_or_a_token_not_allowed(tiny_core, spec):
    greedy = {"max_tokens": 12, "temperature": 0, "ignore_eos": True, "speculative": spec}
    plain = run_requests(tiny_core(), [PROMPT], SamplingParams(**greedy))[0]
    pair = plain[3:5]  # a two-token word the model writes greedily
    out = run_requests(tiny_core(), [PROMPT], bad([pair], **greedy))[0]
    assert out[:4] == plain[:4] and out[4] != plain[4]
    assert all(out[i:i + 2] != pair for i in range(len(out) - 1))
    allowed = sorted(set(plain[::2]))[:2] + [plain[1] + 1]
    for seed in (None, 3):
        kw = greedy | ({"temperature": 1.0, "seed": seed} if seed is not None else {})
        out = run_requests(tiny_core(), [PROMPT], SamplingParams(allowed_token_ids=allowed, **kw))[0]
        assert set(out) <= set(allowed) and len(out) == 12


@pytest.mark.parametrize("kw,msg", [({"allowed_token_ids": []}, "allowed_token_ids"),
                                    ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
                                    ({"allowed_token_ids": 5}, "allowed_token_ids"),
                                    ({"bad_words": [""]}, "bad_words"), ({"bad_words": [3]}, "bad_words"),
                                    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
                                    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
                                    ({"bad_words": ["a"], "use_beam_search": True}, "bad_words"),
                                    ({"allowed_token_ids": [1], "use_beam_search": True}, "allowed_token_ids")])
def test_bad_values_one_line_errors(kw, msg):
    with pytest.raises(RequestError, match=msg) as e:
        SamplingParams(**kw)
    assert "\n" not in str(e.value)


def test_offline_bad_words_truncation_and_prompt_dicts_on_smollm(smollm):
    """LLM tokenizes bad_words itself (a word the model writes greedily is then never written), keeps the last
    truncate_prompt_tokens tokens, and takes vLLM's prompt dicts."""
    prompt = "The capital of France is Paris. The capital of Germany is"
    greedy = SamplingParams(max_tokens=8, temperature=0)
    plain = smollm.generate(prompt, greedy)[0]
    word = plain.text.split()[0].strip(".")  # "Berlin": two tokens alone, one (" Berlin") after a space
    out = smollm.generate(prompt, SamplingParams(max_tokens=8, temperature=0, bad_words=[word]))[0]
    assert word not in out.text and out.text != plain.text
    ids = smollm.tokenizer.encode(prompt)
    cut = smollm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=4, temperature=0,
                                                                  truncate_prompt_tokens=5))[0]
    assert cut.prompt_token_ids == ids[-5:]
    assert cut.token_ids == smollm.generate([ids[-5:]], SamplingParams(max_tokens=4, temperature=0))[0].token_ids
    whole = smollm.generate([ids], SamplingParams(max_tokens=1, temperature=0, truncate_prompt_tokens=-1))[0]
    assert whole.prompt_token_ids == ids  # -1: the context's length, as vLLM
    by_dict = smollm.generate([{"prompt": prompt}], greedy)[0]
    assert by_dict.text == plain.text and by_dict.prompt == prompt
    with pytest.raises(RequestError, match="prompt_token_ids"):
        smollm.generate({"text": prompt}, greedy)


def test_cli_flags():
    import argparse

    from tokenhaul.cli import add_sampling_args, sampling_params

    p = argparse.ArgumentParser()
    add_sampling_args(p)
    sp = sampling_params(p.parse_args(["--bad-words", "Berlin", "--bad-words", "Paris", "--allowed-token-ids", "3",
                                       "--allowed-token-ids", "9", "--truncate-prompt-tokens", "7"]))
    assert (sp.bad_words, sp.allowed_token_ids, sp.truncate_prompt_tokens) == (["Berlin", "Paris"], [3, 9], 7)
    assert sampling_params(p.parse_args([])).allowed_token_ids is None


def test_detokenize_false_gives_ids_only_and_clone_copies(smollm):
    prompt = "The capital of France is"
    with_text = smollm.generate(prompt, SamplingParams(max_tokens=6, temperature=0))[0]
    ids_only = smollm.generate(prompt, SamplingParams(max_tokens=6, temperature=0, detokenize=False))[0]
    assert ids_only.token_ids == with_text.token_ids and with_text.text and ids_only.text == ""
    with pytest.raises(RequestError, match="detokenize"):
        SamplingParams(stop=["."], detokenize=False)
    p = SamplingParams(bad_words=["a"], allowed_token_ids=[1, 2])
    p.bad_words_token_ids = [[7]]
    q = p.clone()
    assert q == p and q.bad_words_token_ids == [[7]] and q.allowed_token_ids is not p.allowed_token_ids
