"""Speculation on real models, fp32: greedy output is plain greedy's, token for token, alone and in a
batch mixed with plain requests; drafts are accepted on input-grounded text."""

from __future__ import annotations

import pytest

from tokenhaul.sampling_params import SamplingParams

pytestmark = pytest.mark.real_model

FUNCS = ["def add(a, b):\n    return a + b", "def is_even(n):\n    return n % 2 == 0",
         "def greet(name):\n    print('Hello, ' + name)", "def square(x):\n    return x * x",
         "def first(items):\n    return items[0]"]
PASSAGES = ["The river rises in the hills, runs past the mill and the old bridge, and reaches the sea at the port.",
            "Bees collect nectar from flowers, carry it to the hive, and turn it into honey over many days.",
            "The train leaves the station at nine, stops at two towns, and arrives in the city at noon.",
            "A library lends books, keeps them in order on shelves, and helps readers find what they need.",
            "Bread is made from flour, water, salt and yeast; the dough rises, is shaped and then baked."]
PROMPTS = ([f"Rewrite this function with a docstring:\n{f}\n" for f in FUNCS]
           + [f"Repeat this sentence exactly: {p}\n" for p in PASSAGES])


def params(spec: str, max_tokens: int = 24) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, speculative=spec,
                          num_speculative_tokens=4)


@pytest.fixture(scope="module")
def plain(smollm):
    return [o.token_ids for o in smollm.generate(PROMPTS, params("off"))]  # batch invariance: test_core_real


@pytest.mark.parametrize("spec", ["prompt_lookup", "jacobi"])
def test_greedy_equals_plain_on_10_prompts(smollm, plain, spec):
    outs = smollm.generate(PROMPTS[:5], params(spec)) + smollm.generate(PROMPTS[5:], params(spec))
    assert [o.token_ids for o in outs] == plain
    s = [outs[0].ledger.summary(), outs[5].ledger.summary()]
    assert sum(x["proposed_tokens"] for x in s) > 0
    if spec == "prompt_lookup":
        assert sum(x["accepted_tokens"] for x in s) > len(PROMPTS)  # drafts were really kept
    mixed = [params(spec if i % 2 else "off") for i in range(6)]
    assert [o.token_ids for o in smollm.generate(PROMPTS[2:8], mixed)] == plain[2:8]
    assert smollm.core.pool.num_used == 0


def test_stop_string_ends_token_ids_as_plain(smollm, plain):
    """A stop string inside a run of accepted drafts: token_ids (and logprobs) end at the token that
    completed it, as in plain decoding, not at the last accepted draft."""
    prompt, stop = PROMPTS[7], " leaves"  # smollm copies the train sentence: the stop ends inside accepted drafts
    assert stop in smollm.tokenizer.decode(plain[7])
    outs = smollm.generate([prompt, prompt], [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                             stop=[stop], logprobs=0, speculative=spec,
                                                             num_speculative_tokens=4)
                                              for spec in ("off", "prompt_lookup")])
    ref, spec = outs
    assert ref.finish_reason == spec.finish_reason == "stop" and spec.stop_reason == stop
    assert spec.text == ref.text and spec.token_ids == ref.token_ids
    assert [list(d) for d in spec.outputs[0].logprobs] == [[t] for t in spec.token_ids]  # logprobs=0: the token
    assert spec.ledger.summary()["accepted_tokens"] > 0


CODE = [f"def {name}(" for name in ("fibonacci", "quicksort", "is_prime", "reverse_string", "gcd", "flatten",
                                     "binary_search", "factorial", "count_words", "merge_sorted")]


def test_draft_model_greedy_equals_plain_qwen_pair():
    """qwen2.5-coder-0.5b drafts for qwen2.5-coder-1.5b (fp32), few tokens: 10 prompts with the draft
    in one batch with the same 10 plain (speculation kept on at that batch size for the test). fp32 needs
    ~10 GB of memory here."""
    from tokenhaul.llm import LLM

    llm = LLM("qwen2.5-coder-1.5b", dtype="fp32", draft_model="qwen2.5-coder-0.5b", kv_memory_gib=0.25,
              speculative_max_batch=32)
    outs = llm.generate(CODE + CODE, [params("draft", 8)] * len(CODE) + [params("off", 8)] * len(CODE))
    plain = [o.token_ids for o in outs[len(CODE):]]  # plain in a batch == plain alone (test_core_real)
    assert [o.token_ids for o in outs[:len(CODE)]] == plain
    s = outs[0].ledger.summary()
    assert s["accepted_tokens"] > 0 and s["rejected_tokens"] == s["proposed_tokens"] - s["accepted_tokens"]
    assert llm.core.pool.num_used == 0
