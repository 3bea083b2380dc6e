"""The official `openai` client, unchanged, against the server on the real model."""

from __future__ import annotations

import openai
import pytest
from serverkit import MODEL

from tokenhaul.server.chat_protocol import ChatCompletionChunk, ChatCompletionResponse
from tokenhaul.server.completion_protocol import CompletionResponse

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def oai(real_server):
    with openai.OpenAI(base_url=real_server[0] + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def test_models(oai):
    listed = list(oai.models.list())
    assert [m.id for m in listed] == [MODEL]
    assert oai.models.retrieve(MODEL) == listed[0]
    with pytest.raises(openai.NotFoundError) as e:
        oai.models.retrieve("nope")
    assert e.value.body["code"] == "model_not_found"


def test_completions_plain_and_stream(oai):
    kw = dict(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0)
    r = oai.completions.create(**kw)
    CompletionResponse.model_validate(r.model_dump())
    text = r.choices[0].text
    assert "Paris" in text and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0
    chunks = list(oai.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert chunks[-2].choices[0].finish_reason == r.choices[0].finish_reason


def test_completions_logprobs(oai):
    r = oai.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == r.choices[0].text
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and len(top) == 2 and top[tok] == max(top.values()) == pytest.approx(value)  # greedy


def test_logit_bias(oai, real_server):
    """The client sends logit_bias as given ({token id: bias}, JSON's string keys): +100 forces that token."""
    tok = real_server[1].tokenizer
    tid = tok.encode(" banana", add_special_tokens=False)[0]
    r = oai.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0,
                               logit_bias={str(tid): 100})
    assert r.choices[0].text == tok.decode([tid] * 3)
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                    temperature=0, logit_bias={str(tid): 100})
    assert r.choices[0].message.content == tok.decode([tid] * 3)


def test_chat_plain_and_stream(oai):
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=16, temperature=0.7, seed=7)
    r = oai.chat.completions.create(**kw)
    ChatCompletionResponse.model_validate(r.model_dump())
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content
    stream = oai.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    for c in chunks:
        ChatCompletionChunk.model_validate(c.model_dump())
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content
    assert chunks[-1].usage.total_tokens == r.usage.total_tokens


def test_chat_logprobs_and_n_with_seed(oai):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Say something."}], max_tokens=8,
              temperature=1.0, seed=42, logprobs=True, top_logprobs=3)
    two = oai.chat.completions.create(**kw, n=2)
    assert [c.index for c in two.choices] == [0, 1]
    for c in two.choices:
        assert len(c.logprobs.content) == two.usage.completion_tokens // 2 or c.finish_reason == "stop"
        assert all(len(t.top_logprobs) == 3 for t in c.logprobs.content)
        joined = bytes(b for t in c.logprobs.content for b in t.bytes).decode(errors="replace")
        assert joined.startswith(c.message.content)  # each token's own bytes (a split character's parts)
    one = oai.chat.completions.create(**kw | {"seed": 43})  # choice 1 of seed 42 is seeded 43
    assert one.choices[0].message.content == two.choices[1].message.content


def test_errors_surface_as_openai_exceptions(oai):
    with pytest.raises(openai.NotFoundError) as e:
        oai.completions.create(model="nope", prompt="x")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=-1)
    assert "max_tokens" in e.value.message


def test_beam_search_n_choices_are_the_n_best_beams(oai, real_server, smollm):
    """use_beam_search with n: the n choices are the offline n best beams, best first (vLLM), streamed or not;
    the usage counts every beam's tokens. (It was n copies of the best beam.)"""
    from tokenhaul.sampling_params import SamplingParams

    prompt = "The capital of France is"
    beams = smollm.generate(prompt, SamplingParams(max_tokens=12, temperature=0, use_beam_search=True,
                                                   beam_width=4, n=2))[0].beams
    texts = [b.text for b in beams]
    assert len(texts) == 2 and texts[0] != texts[1]
    kw = dict(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, n=2,
              extra_body={"use_beam_search": True, "beam_width": 4})
    r = oai.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == texts
    assert r.usage.completion_tokens == sum(len(b.token_ids) for b in beams)
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)
    chunks = list(oai.completions.create(**kw, stream=True))
    got = ["", ""]
    for c in chunks:
        for ch in c.choices:
            got[ch.index] += ch.text
    assert got == texts
    chat = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a colour."}],
                                       max_tokens=8, temperature=0, n=2,
                                       extra_body={"use_beam_search": True, "beam_width": 4})
    contents = [c.message.content for c in chat.choices]
    assert len(contents) == 2 and contents[0] != contents[1]
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(**kw, logprobs=1)
    assert "use_beam_search" in e.value.message
