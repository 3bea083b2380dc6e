"""vLLM's prompt_logprobs over HTTP (completions per choice, chat at the response level) and OpenAI's echo with
logprobs (the prompt's tokens first), against the offline LLM.generate on the same SmolLM2 weights."""

from __future__ import annotations

import math

import openai
import pytest
from serverkit import MODEL

from tokenhaul.sampling_params import SamplingParams
from tokenhaul.server.chat_protocol import ChatCompletionResponse
from tokenhaul.server.completion_protocol import CompletionResponse

pytestmark = pytest.mark.real_model

PROMPT = "The capital of France is Paris, and the capital of Spain is"
K = 3
TOL = 1e-4  # fp32 both ways; the server's batch and KV pool differ from the offline call's


@pytest.fixture(scope="module")
def oai(real_server):
    with openai.OpenAI(base_url=real_server[0] + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def offline(smollm):
    """(prompt ids, prompt logprobs) of PROMPT from LLM.generate with prompt_logprobs=K (vLLM's offline shape: per
    token after the first a dict token id -> Logprob)."""
    out = smollm.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=K))[0]
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids) > 5
    return out.prompt_token_ids, out.prompt_logprobs


def best(want: dict, k: int) -> list[int]:
    """The k most likely token ids of an offline prompt_logprobs dict (its top entries rank 1..K), best first."""
    return [t for _, t in sorted((v.rank, t) for t, v in want.items() if v.rank <= k)]


def check_prompt_logprobs(got: list, offline, tokenizer, k: int = K) -> None:
    """vLLM's shape: None for the first token; then the prompt token's entry first, then the k best ranked 1..k;
    the values those of the offline call."""
    ids, ref = offline
    assert len(got) == len(ids) and got[0] is None and ref[0] is None
    for tid, entries, want in zip(ids[1:], got[1:], ref[1:]):
        keys = list(entries)
        assert keys[0] == str(tid)
        top = [str(t) for t in best(want, k)]
        assert keys[1:] == [t for t in top if t != str(tid)]
        own = entries[str(tid)]
        assert math.isclose(own["logprob"], want[tid].logprob, abs_tol=TOL)
        assert own["decoded_token"] == want[tid].decoded_token == tokenizer.decode([tid], skip_special_tokens=False)
        assert own["rank"] == (top.index(str(tid)) + 1 if str(tid) in top else want[tid].rank) and own["rank"] >= 1
        for rank, t in enumerate(best(want, k), 1):
            e = entries[str(t)]
            assert e["rank"] == rank and math.isclose(e["logprob"], want[t].logprob, abs_tol=TOL)


def test_completions_prompt_logprobs_equal_offline(real_server, client, offline):
    url, engine = real_server
    r = client.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "n": 2,
                                                    "prompt_logprobs": K})
    assert r.status_code == 200, r.text
    body = r.json()
    CompletionResponse.model_validate(body)
    for choice in body["choices"]:  # every choice of the prompt carries its prompt's (vLLM)
        check_prompt_logprobs(choice["prompt_logprobs"], offline, engine.tokenizer)
        assert choice["logprobs"] is None
    ranks = [e[str(t)]["rank"] for t, e in zip(offline[0][1:], body["choices"][0]["prompt_logprobs"][1:])]
    assert max(ranks) > K  # the prompt has tokens outside the top K: ranked among the whole vocabulary
    plain = client.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0}).json()
    assert plain["choices"][0]["prompt_logprobs"] is None
    assert plain["choices"][0]["text"] == body["choices"][0]["text"]


def test_prompt_logprobs_zero_gives_the_prompt_tokens_alone(real_server, client, offline):
    url, engine = real_server
    body = client.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 0}).json()
    got = body["choices"][0]["prompt_logprobs"]
    check_prompt_logprobs(got, offline, engine.tokenizer, k=0)
    assert all(len(e) == 1 for e in got[1:])


def test_chat_prompt_logprobs_at_the_response_level(real_server, client, smollm):
    url, engine = real_server
    msgs = [{"role": "user", "content": "Name a colour."}]
    r = client.post(url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 2, "temperature": 0,
                                                         "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    ChatCompletionResponse.model_validate(body)
    ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(msgs), add_special_tokens=False)
    assert body["usage"]["prompt_tokens"] == len(ids)
    ref = smollm.generate(ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))[0].prompt_logprobs
    check_prompt_logprobs(body["prompt_logprobs"], (ids, ref), engine.tokenizer, k=2)
    assert "prompt_logprobs" not in body["choices"][0]


def test_echo_with_logprobs_covers_prompt_and_completion(real_server, client, offline):
    url, engine = real_server
    ids, ref = offline
    n_prompt = len(ids)
    r = client.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                                                    "echo": True, "logprobs": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    CompletionResponse.model_validate(body)
    choice = body["choices"][0]
    lp = choice["logprobs"]
    n = n_prompt + body["usage"]["completion_tokens"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v is not None for v in lp["token_logprobs"][1:]) and all(t for t in lp["top_logprobs"][1:])
    assert choice["text"].startswith(PROMPT) and "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"][0] == 0 and lp["text_offset"][n_prompt] == len(PROMPT)
    assert [choice["text"][a:b] for a, b in zip(lp["text_offset"], lp["text_offset"][1:])] == lp["tokens"][:-1]
    for i in range(1, n_prompt):  # the prompt's: its logprob, the 2 best and the token itself
        assert math.isclose(lp["token_logprobs"][i], ref[i][ids[i]].logprob, abs_tol=TOL)
        tok = lp["tokens"][i]
        want = {engine.tokenizer.decode([t], skip_special_tokens=False) for t in best(ref[i], 2)} | {tok}
        assert set(lp["top_logprobs"][i]) == want
    plain = client.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                                                        "logprobs": 2}).json()["choices"][0]
    assert lp["tokens"][n_prompt:] == plain["logprobs"]["tokens"]  # the completion's, as without echo
    assert lp["token_logprobs"][n_prompt:] == pytest.approx(plain["logprobs"]["token_logprobs"], abs=TOL)
    # vLLM asks for prompt_logprobs = logprobs with echo, and the choice carries them too
    check_prompt_logprobs(choice["prompt_logprobs"], offline, engine.tokenizer, k=2)


def test_echo_with_logprobs_streamed_as_not_streamed(real_server, client, monkeypatch):
    """Streamed, each choice's first chunk carries its prompt and the prompt's logprobs with its first token
    (vLLM); put together, the chunks say what the non-streamed response says. As not streamed, only each prompt's
    first choice asks the engine for them (the others share its prefix cache)."""
    import json

    url, engine = real_server
    url += "/v1/completions"
    req = {"prompt": [PROMPT, "1, 2, 3,"], "n": 2, "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 1}
    whole = client.post(url, json=req).json()
    got = {i: {"text": "", "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
           for i in range(4)}
    firsts = {}
    asked, add = [], engine.client.add
    monkeypatch.setattr(engine.client, "add", lambda msg: asked.append(msg.params.prompt_logprobs) or add(msg))
    with client.stream("POST", url, json=req | {"stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                firsts.setdefault(c["index"], c)
                got[c["index"]]["text"] += c["text"]
                for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    got[c["index"]][key] += c["logprobs"][key]
    for i, c in enumerate(whole["choices"]):
        assert firsts[i]["text"].startswith([PROMPT, "1, 2, 3,"][i // 2]) and firsts[i]["logprobs"]["tokens"]
        assert got[i]["text"] == c["text"]
        assert got[i]["tokens"] == c["logprobs"]["tokens"] and got[i]["text_offset"] == c["logprobs"]["text_offset"]
        assert got[i]["token_logprobs"][0] is None and got[i]["top_logprobs"][0] is None
        assert got[i]["token_logprobs"][1:] == pytest.approx(c["logprobs"]["token_logprobs"][1:], abs=TOL)
    assert asked == [1, None, 1, None]


def test_openai_client_parses_prompt_logprobs_and_echo(oai, offline, real_server):
    tok = real_server[1].tokenizer
    r = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0,
                               extra_body={"prompt_logprobs": K})
    check_prompt_logprobs(r.choices[0].model_extra["prompt_logprobs"], offline, tok)
    r = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert len(lp.tokens) == len(offline[0]) + r.usage.completion_tokens and r.choices[0].text.startswith(PROMPT)
    chat = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       extra_body={"prompt_logprobs": 1})
    plps = chat.model_extra["prompt_logprobs"]
    assert len(plps) == chat.usage.prompt_tokens and plps[0] is None and all(len(e) in (1, 2) for e in plps[1:])
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=MODEL, prompt=PROMPT, stream=True, extra_body={"prompt_logprobs": 1})
    assert e.value.body["param"] == "prompt_logprobs"


def _prompt_part(lp: dict, n: int) -> dict:
    """The first n tokens' rows of completions logprobs."""
    return {key: lp[key][:n] for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def check_same_logprobs(got: dict, want: dict) -> None:
    assert got["tokens"] == want["tokens"] and got["text_offset"] == want["text_offset"]
    assert got["token_logprobs"][0] is None is want["token_logprobs"][0]
    assert got["token_logprobs"][1:] == pytest.approx(want["token_logprobs"][1:], abs=TOL)
    assert got["top_logprobs"][0] is None is want["top_logprobs"][0]
    for g, w in zip(got["top_logprobs"][1:], want["top_logprobs"][1:]):
        assert g == pytest.approx(w, abs=TOL)


def test_echo_with_max_tokens_zero_scores_the_prompt(real_server, client, offline):
    """OpenAI's prompt scoring (vLLM's echo without generation): each choice is the prompt alone with its logprobs,
    those of echo with max_tokens 1 less its completion token; no completion token is counted; finish_reason length.
    Without echo, max_tokens 0 stays a 400 naming max_tokens."""
    url, engine = real_server
    ids = offline[0]
    req = {"prompt": PROMPT, "echo": True, "logprobs": 2, "temperature": 0.8, "seed": 7, "n": 2}
    r = client.post(url + "/v1/completions", json=req | {"max_tokens": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    CompletionResponse.model_validate(body)
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    one = client.post(url + "/v1/completions", json=req | {"max_tokens": 1}).json()["choices"][0]
    assert len(one["logprobs"]["tokens"]) == len(ids) + 1
    assert len(body["choices"]) == 2
    for i, choice in enumerate(body["choices"]):
        assert choice["index"] == i and choice["text"] == PROMPT
        assert (choice["finish_reason"], choice["stop_reason"]) == ("length", None)
        assert len(choice["logprobs"]["tokens"]) == len(ids)
        check_same_logprobs(choice["logprobs"], _prompt_part(one["logprobs"], len(ids)))
        check_prompt_logprobs(choice["prompt_logprobs"], offline, engine.tokenizer, k=2)
    for bad in ({"echo": False}, {"logprobs": 2}, {}):
        r = client.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 0} | bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text


def test_echo_with_max_tokens_zero_token_ids_and_no_logprobs(real_server, client, offline):
    """A prompt of token ids is echoed decoded; without logprobs the choice is the prompt's text alone."""
    url, engine = real_server
    ids = offline[0]
    body = client.post(url + "/v1/completions", json={"prompt": [ids, ids[:3]], "max_tokens": 0, "echo": True,
                                                       "logprobs": 0}).json()
    assert body["usage"] == {"prompt_tokens": len(ids) + 3, "completion_tokens": 0, "total_tokens": len(ids) + 3}
    texts = [engine.tokenizer.decode(p, skip_special_tokens=True) for p in (ids, ids[:3])]
    assert [c["text"] for c in body["choices"]] == texts and texts[0] == PROMPT
    for c, p in zip(body["choices"], (ids, ids[:3])):
        lp = c["logprobs"]
        assert lp["tokens"] == [engine.tokenizer.decode([t], skip_special_tokens=False) for t in p]
        assert len(lp["token_logprobs"]) == len(p) and lp["token_logprobs"][0] is None
    plain = client.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 0, "echo": True}).json()
    assert plain["choices"][0]["text"] == PROMPT and plain["choices"][0]["logprobs"] is None
    assert plain["choices"][0]["finish_reason"] == "length" and plain["usage"]["completion_tokens"] == 0


@pytest.mark.parametrize("logprobs", [None, 1])
def test_echo_with_max_tokens_zero_streamed(real_server, client, logprobs, monkeypatch):
    """Streamed, each choice comes as one chunk: its prompt (with its logprobs), finish_reason length; the same as
    the non-streamed response, and the usage counts no completion token."""
    import json

    url, engine = real_server
    url += "/v1/completions"
    req = {"prompt": [PROMPT, "1, 2, 3,"], "n": 2, "max_tokens": 0, "echo": True, "logprobs": logprobs}
    whole = client.post(url, json=req).json()
    chunks, usage = [], None
    asked, add = [], engine.client.add
    monkeypatch.setattr(engine.client, "add", lambda msg: asked.append(msg.params.prompt_logprobs) or add(msg))
    with client.stream("POST", url, json=req | {"stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                data = json.loads(line[6:])
                chunks += data["choices"]
                usage = data.get("usage") or usage
    assert sorted(c["index"] for c in chunks) == [0, 1, 2, 3]
    assert usage == whole["usage"] and usage["completion_tokens"] == 0
    for c in chunks:
        want = whole["choices"][c["index"]]
        assert c["text"] == want["text"] == [PROMPT, "1, 2, 3,"][c["index"] // 2]
        assert (c["finish_reason"], c["stop_reason"]) == ("length", None)
        if logprobs is None:
            assert c["logprobs"] is None is want["logprobs"]
        else:
            check_same_logprobs(c["logprobs"], want["logprobs"])
    assert asked == [logprobs, None] * 2  # each prompt's first choice alone computes its logprobs


def test_openai_client_parses_prompt_scoring(oai, offline):
    r = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    choice = r.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(offline[0])
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(offline[0]) and "".join(lp.tokens) == PROMPT
    assert lp.token_logprobs[0] is None and all(v < 0 for v in lp.token_logprobs[1:])
    ids, ref = offline
    assert lp.token_logprobs[1:] == pytest.approx([d[t].logprob for d, t in zip(ref[1:], ids[1:])], abs=TOL)
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)
    assert e.value.body["param"] == "max_tokens"
