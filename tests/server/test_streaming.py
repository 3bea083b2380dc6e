"""Streamed text equals non-streamed text; stop strings never leak, streamed or not.

Exhaustive over stop-string positions on the scripted model (its output mixes ASCII, CJK, emoji and
code, split across tokens); then on the real model with Chinese, emoji and code prompts."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

CMPL = "/v1/completions"


def sse(c: httpx.Client, url: str, body: dict) -> tuple[list[dict], list[str]]:
    """POST a streaming request → (JSON chunks, raw data lines incl. [DONE])."""
    with c.stream("POST", url, json=body | {"stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        data = [ln[len("data: "):] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]], data


def stream_text(c: httpx.Client, url: str, body: dict) -> tuple[str, str | None]:
    """Concatenated text of choice 0 of a streamed completion, and its finish reason."""
    chunks, _ = sse(c, url, body)
    text, finish = "", None
    for ch in chunks:
        for choice in ch["choices"]:
            text += choice["text"]
            finish = choice["finish_reason"] or finish
    return text, finish


def plain_text(c: httpx.Client, url: str, body: dict) -> tuple[str, str | None]:
    r = c.post(url, json=body)
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    return ch["text"], ch["finish_reason"]


def both(c: httpx.Client, url: str, body: dict) -> tuple[tuple[str, str | None], tuple[str, str | None]]:
    return plain_text(c, url, body), stream_text(c, url, body)


# scripted model ------------------------------------------------------------------------------------
def test_script_stream_equals_plain_and_stops_never_leak(script_server, client):
    url = script_server[0] + CMPL
    base = {"prompt": "Start:", "max_tokens": 48, "temperature": 0}
    (ref, fin), streamed = both(client, url, base)
    assert fin == "length" and streamed == (ref, fin)
    assert "你好" in ref and "🚀" in ref and "return" in ref
    stops = {ref[i:i + k] for i in range(0, len(ref) - 3, 2) for k in (1, 3) if ref[i:i + k].strip()}
    stops |= {"你好", "世界。🙂", "🚀", "return", "\n    ", "b):", "done.\n"}
    cases = []
    for stop in sorted(stops):
        cut = ref.find(stop)
        cases += [({"stop": stop}, ref[:cut]),
                  ({"stop": [stop], "include_stop_str_in_output": True}, ref[:cut + len(stop)])]
    with ThreadPoolExecutor(16) as pool:  # the scripted model's output does not depend on the batch
        got = list(pool.map(lambda case: both(client, url, base | case[0]), cases))
    for (body, want), ((p, pf), (s, sf)) in zip(cases, got):
        assert p == s == want, (body, p, s, want)
        assert pf == sf == "stop"


def test_script_min_tokens_defers_stop_strings(script_server, client):
    """min_tokens (vLLM's): a stop string ending within the first min_tokens tokens' text does not stop the request;
    the first one ending after does, streamed or not."""
    url = script_server[0] + CMPL
    base = {"prompt": "Start:", "max_tokens": 48, "temperature": 0}
    r = client.post(url, json=base | {"logprobs": 0}).json()["choices"][0]
    ref, offsets = r["text"], r["logprobs"]["text_offset"]
    first = ref.find("o")
    m = next(k for k in range(len(offsets)) if offsets[k] > first)  # the first "o" is in the first m tokens' text
    want = ref[:ref.find("o", offsets[m])]
    assert len(want) > first
    assert both(client, url, base | {"stop": "o", "min_tokens": m}) == ((want, "stop"), (want, "stop"))
    assert both(client, url, base | {"stop": "o"}) == ((ref[:first], "stop"), (ref[:first], "stop"))


def test_script_several_stops_earliest_wins(script_server, client):
    url = script_server[0] + CMPL
    base = {"prompt": "Start:", "max_tokens": 48, "temperature": 0}
    ref, _ = plain_text(client, url, base)
    stops = ["return", "世界", "🚀"]
    want = ref[:min(ref.find(s) for s in stops)]
    assert both(client, url, base | {"stop": stops}) == ((want, "stop"), (want, "stop"))


def test_script_n_choices_stream(script_server, client):
    url = script_server[0] + CMPL
    chunks, _ = sse(client, url, {"prompt": ["a", "b b b"], "n": 2, "max_tokens": 6,
                                  "stream_options": {"include_usage": True}})
    texts = ["", "", "", ""]
    for ch in chunks[:-1]:
        for choice in ch["choices"]:
            texts[choice["index"]] += choice["text"]
    assert texts[0] == texts[1] and texts[2] == texts[3] and texts[0] != texts[2]
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage["completion_tokens"] == 24


def test_script_echo_puts_each_prompt_before_its_choices(script_server, client, tokenizer):
    """echo (OpenAI, vLLM): each choice's text is its prompt, then the completion; streamed, the prompt comes first;
    a prompt of token ids is echoed decoded; usage counts as without echo."""
    from tokenhaul.server.completion_protocol import CompletionResponse

    url = script_server[0] + CMPL
    prompts = ["Start:", "你好 b b"]
    base = {"prompt": prompts, "n": 2, "max_tokens": 6, "temperature": 0}
    ref = client.post(url, json=base).json()
    r = client.post(url, json=base | {"echo": True}).json()
    CompletionResponse.model_validate(r)
    want = [prompts[i // 2] + ref["choices"][i]["text"] for i in range(4)]
    assert [c["text"] for c in r["choices"]] == want and r["usage"] == ref["usage"]
    chunks, _ = sse(client, url, base | {"echo": True, "stream_options": {"include_usage": True}})
    assert [ch["choices"] for ch in chunks[:4]] == [[{"index": i, "text": prompts[i // 2], "logprobs": None,
                                                      "finish_reason": None, "stop_reason": None}] for i in range(4)]
    texts = ["", "", "", ""]
    for ch in chunks[:-1]:
        for c in ch["choices"]:
            texts[c["index"]] += c["text"]
    assert texts == want and chunks[-1]["usage"] == ref["usage"]
    ids = tokenizer.encode("Start:")
    r = client.post(url, json={"prompt": ids, "max_tokens": 6, "temperature": 0, "echo": True}).json()
    assert r["choices"][0]["text"] == tokenizer.decode(ids) + ref["choices"][0]["text"]


def test_script_echo_logprobs_offsets_index_the_echoed_text(script_server, client, tokenizer):
    """echo with logprobs: text_offset indexes the echoed text. A prompt of ids is echoed decoded, so its special
    tokens take no characters unless skip_special_tokens is false; the completion's start at the echo's end;
    streamed, the same offsets."""
    url = script_server[0] + CMPL
    ids = [1] + tokenizer.encode("你好 b", add_special_tokens=False)  # <|im_start|>, then a split character
    assert tokenizer.is_special(1)
    for skip in (True, False):
        body = {"prompt": ids, "max_tokens": 3, "ignore_eos": True, "echo": True, "logprobs": 0,
                "skip_special_tokens": skip}
        c = client.post(url, json=body).json()["choices"][0]
        lp = c["logprobs"]
        echoed = tokenizer.decode(ids, skip_special_tokens=skip)
        assert c["text"].startswith(echoed) and len(lp["tokens"]) == len(ids) + 3
        assert lp["token_logprobs"][0] is None and None not in lp["token_logprobs"][1:]
        assert lp["text_offset"][1] == (0 if skip else len("<|im_start|>"))
        assert lp["text_offset"][len(ids)] == len(echoed)
        chunks, _ = sse(client, url, body)
        assert [o for ch in chunks for x in ch["choices"] for o in x["logprobs"]["text_offset"]] == lp["text_offset"]


def test_script_chat_prompt_continue_final_message_and_no_generation_prompt(script_server, client, tokenizer):
    """vLLM's chat extras: add_generation_prompt false renders no assistant header; continue_final_message continues
    the last message (an assistant prefill: no end-of-turn after it); both true is a 400 naming the field."""
    url = script_server[0] + "/v1/chat/completions"
    msgs = [{"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "Seven, or"}]
    no_gen = {"add_generation_prompt": False}
    for extra in ({}, no_gen, no_gen | {"continue_final_message": True}):
        r = client.post(url, json={"messages": msgs, "max_tokens": 2} | extra)
        assert r.status_code == 200, r.text
        gen, cont = extra.get("add_generation_prompt", True), extra.get("continue_final_message", False)
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=gen, continue_final_message=cont)
        assert r.json()["usage"]["prompt_tokens"] == len(tokenizer.encode(text, add_special_tokens=False)), extra
        assert text.endswith("Seven, or") == cont and text.endswith("assistant\n") == gen
    r = client.post(url, json={"messages": msgs, "max_tokens": 2, "continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.text


def test_script_continuous_usage_stats_every_chunk(script_server, client):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far (completion tokens never
    decrease), the last one that of the whole call; completions and chat."""
    url = script_server[0]
    for path, body in ((CMPL, {"prompt": ["Start:", "b b"], "n": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        body |= {"max_tokens": 6, "temperature": 0}
        want = client.post(url + path, json=body).json()["usage"]
        chunks, _ = sse(client, url + path, body | {"stream_options": {"continuous_usage_stats": True}})
        done = [ch["usage"]["completion_tokens"] for ch in chunks]
        assert done == sorted(done) and chunks[-1]["usage"] == want, path
        assert all(ch["usage"]["prompt_tokens"] == want["prompt_tokens"] for ch in chunks)


def test_script_chat_text_parts_join_with_newlines(script_server, client, tokenizer):
    """A message's text parts are one content joined by newlines, as vLLM renders them for a template taking a
    string: the same prompt as that string."""
    url = script_server[0] + "/v1/chat/completions"
    parts = [{"type": "text", "text": "first part"}, {"type": "text", "text": "second"}]

    def prompt_tokens(content: str | list) -> int:
        r = client.post(url, json={"messages": [{"role": "user", "content": content}], "max_tokens": 1})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    joined = tokenizer.apply_chat_template([{"role": "user", "content": "first part\nsecond"}])
    assert prompt_tokens(parts) == prompt_tokens("first part\nsecond") == len(tokenizer.encode(joined, False))


def test_script_logprobs_bytes_and_offsets_across_split_characters(script_server, client):
    """The scripted text's CJK and emoji come in tokens carrying parts of a character: chat logprobs' `bytes`
    join to the content, and completions' `text_offset` is where each token's text starts, streamed or not."""
    url = script_server[0]
    base = {"max_tokens": 40, "temperature": 0}
    r = client.post(url + "/v1/chat/completions", json=base | {"messages": [{"role": "user", "content": "x"}],
                                                              "logprobs": True, "top_logprobs": 2})
    choice = r.json()["choices"][0]
    content, entries = choice["message"]["content"], choice["logprobs"]["content"]
    assert "🙂" in content and any(e["token"] == "\ufffd" for e in entries)  # split characters are covered
    assert bytes(b for e in entries for b in e["bytes"]).decode() == content
    for e in entries:
        top = {t["token"]: bytes(t["bytes"]) for t in e["top_logprobs"]}
        assert bytes(e["bytes"]) in top.values()  # greedy: the chosen token is among the top, same bytes
    body = base | {"prompt": "Start:", "logprobs": 0}
    plain = client.post(url + CMPL, json=body).json()["choices"][0]
    chunks, _ = sse(client, url + CMPL, body)
    streamed = [o for ch in chunks for c in ch["choices"] if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    offsets, text = plain["logprobs"]["text_offset"], plain["text"]
    assert streamed == offsets and offsets[0] == 0 and offsets == sorted(offsets)
    assert {offsets[i] for i in range(len(offsets)) if "🙂" in text[offsets[i]:offsets[i] + 1]}  # lands on it
    assert all(offsets[i] < len(text) for i in range(len(offsets)))


def test_script_completion_logprobs_0_top_is_the_sampled_token(script_server, client):
    """logprobs 0 (as vLLM): token_logprobs, and top_logprobs entries holding the sampled token alone."""
    from tokenhaul.server.completion_protocol import CompletionResponse

    url = script_server[0] + CMPL
    body = {"prompt": "Start:", "max_tokens": 8, "temperature": 0, "logprobs": 0}
    r = client.post(url, json=body).json()
    CompletionResponse.model_validate(r)
    chunks, _ = sse(client, url, body)
    streamed = [c["logprobs"] for ch in chunks for c in ch["choices"] if c["logprobs"]]
    for lp in [r["choices"][0]["logprobs"], *streamed]:
        assert len(lp["top_logprobs"]) == len(lp["tokens"]) == len(lp["token_logprobs"])
        for tok, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
            assert top == {tok: value} and value <= 0
    assert sum(len(lp["tokens"]) for lp in streamed) == 8


def test_script_logit_bias_completions_and_chat(script_server, client, tokenizer):
    """logit_bias, keyed by token ids as strings (OpenAI's form): +100 outweighs the script's 60-logit margin, greedy
    or sampled, streamed or not; -100 on the script's next token moves greedy off it."""
    url = script_server[0]
    tid = tokenizer.encode(" banana", add_special_tokens=False)[0]
    want = tokenizer.decode([tid] * 5)
    body = {"prompt": "Start:", "max_tokens": 5, "logit_bias": {str(tid): 100}}
    for temperature in (0, 1.0):
        assert both(client, url + CMPL, body | {"temperature": temperature}) == ((want, "length"), (want, "length"))
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "temperature": 0,
            "logit_bias": {str(tid): 100.0}}
    r = client.post(url + "/v1/chat/completions", json=chat)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == want, r.text
    model = script_server[2]
    nxt = int(model.script[len(tokenizer.encode("Start:")) % len(model.script)])  # the script's first token
    r = client.post(url + CMPL, json={"prompt": "Start:", "max_tokens": 1, "temperature": 0, "logprobs": 0,
                                      "logit_bias": {str(nxt): -100, str(tid): 5}})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == [tokenizer.decode([tid])]
    assert lp["token_logprobs"][0] == pytest.approx(-60.0, abs=0.01)  # the raw distribution's, not the biased one's


def test_script_stop_reason_is_the_stop_token_id(script_server, client, tokenizer):
    """Stopped at one of stop_token_ids: stop_reason is that id, an int (vLLM); streamed or not, completions and
    chat."""
    from tokenhaul.server.chat_protocol import ChatCompletionChunk, ChatCompletionResponse
    from tokenhaul.server.completion_protocol import CompletionResponse

    url, _, model = script_server
    script = model.script.tolist()
    first = script[len(tokenizer.encode("Start:")) % len(script)]  # the script's next token after the prompt
    body = {"prompt": "Start:", "max_tokens": 10, "temperature": 0, "stop_token_ids": [first]}
    r = client.post(url + CMPL, json=body).json()
    CompletionResponse.model_validate(r)
    assert r["choices"][0]["finish_reason"] == "stop" and r["choices"][0]["stop_reason"] == first
    chunks, _ = sse(client, url + CMPL, body)
    assert [c["stop_reason"] for ch in chunks for c in ch["choices"] if c["finish_reason"]] == [first]
    stops = sorted(set(script))[:256]
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 10, "temperature": 0,
            "stop_token_ids": stops}
    r = client.post(url + "/v1/chat/completions", json=chat).json()
    ChatCompletionResponse.model_validate(r)
    reason = r["choices"][0]["stop_reason"]
    assert r["choices"][0]["finish_reason"] == "stop" and type(reason) is int and reason in stops
    chunks, _ = sse(client, url + "/v1/chat/completions", chat)
    for ch in chunks:
        ChatCompletionChunk.model_validate(ch)
    assert [c["stop_reason"] for ch in chunks for c in ch["choices"] if c["finish_reason"]] == [reason]
    r = client.post(url + CMPL, json={"prompt": "Start:", "max_tokens": 3, "temperature": 0}).json()
    assert r["choices"][0]["finish_reason"] == "length" and r["choices"][0]["stop_reason"] is None


def test_script_completion_top_logprobs_hold_the_sampled_token(script_server, client, tokenizer):
    """Completions' logprobs k: the k most likely tokens, and the sampled one where it is not among them (OpenAI's
    "as well the chosen tokens", vLLM's k + 1 entries); chat's top_logprobs stay k."""
    from tokenhaul.server.completion_protocol import CompletionResponse

    url = script_server[0]
    tid = tokenizer.encode(" banana", add_special_tokens=False)[0]  # forced: far from the script's top token
    banana = tokenizer.decode([tid])
    plain = {"prompt": "Start:", "max_tokens": 4, "temperature": 0, "logprobs": 1}
    forced = plain | {"logit_bias": {str(tid): 100}}
    for body, size in ((plain, 1), (forced, 2)):
        r = client.post(url + CMPL, json=body).json()
        CompletionResponse.model_validate(r)
        chunks, _ = sse(client, url + CMPL, body)
        streamed = [c["logprobs"] for ch in chunks for c in ch["choices"] if c["logprobs"]]
        for lp in [r["choices"][0]["logprobs"], *streamed]:
            for tok, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
                assert len(top) == size and top[tok] == value and (tok == banana) == (body is forced)
                assert max(top.values()) > -1e-3  # the most likely one is there too
    r = client.post(url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "temperature": 0, "logprobs": True,
        "top_logprobs": 1, "logit_bias": {str(tid): 100}}).json()
    for e in r["choices"][0]["logprobs"]["content"]:
        assert e["token"] == banana and [t["token"] for t in e["top_logprobs"]] != [banana]
        assert len(e["top_logprobs"]) == 1


# real model -------------------------------------------------------------------------------------
PROMPTS = {
    "chinese": "请用中文写一首关于春天的短诗：\n",
    "emoji": "Reply with a row of emojis about a party 🎉🥳: ",
    "code": 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
}


@pytest.mark.real_model
@pytest.mark.parametrize("name", list(PROMPTS))
def test_real_stream_equals_plain_and_stop_does_not_leak(real_server, client, name):
    url = real_server[0] + CMPL
    base = {"prompt": PROMPTS[name], "max_tokens": 24, "temperature": 0.8, "seed": 1234, "ignore_eos": True}
    (text, fin), streamed = both(client, url, base)
    assert streamed == (text, fin) and fin == "length" and text
    mid = len(text) // 2
    stop = text[mid:mid + 2] if text[mid:mid + 2].strip() else text[mid:mid + 3]
    want = text[:text.find(stop)]
    assert both(client, url, base | {"stop": [stop]}) == ((want, "stop"), (want, "stop"))


def choice_texts(chunks: list[dict], chat: bool) -> dict[int, str]:
    """Each choice's streamed text by index; every chunk holds at most one choice (OpenAI's, vLLM's: clients read
    choices[0]), and only the usage chunk none."""
    texts: dict[int, str] = {}
    for ch in chunks:
        assert len(ch["choices"]) <= 1, ch
        assert ch["choices"] or "usage" in ch, ch
        for c in ch["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + ((c["delta"].get("content") or "") if chat else c["text"])
    return texts


@pytest.mark.real_model
@pytest.mark.parametrize("path,body", [
    (CMPL, {"prompt": "Hi", "n": 2}),
    (CMPL, {"prompt": ["Hi", "Once upon a time"], "n": 2, "logprobs": 1, "echo": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "n": 3, "logprobs": True}),
])
def test_real_stream_sends_one_choice_per_chunk(real_server, client, path, body):
    """Streamed n > 1: one choice per chunk (a client reading choices[0] sees every choice), each choice's text in
    order equal to the non-streamed response's at the same seed; the usage chunk has no choice."""
    url = real_server[0] + path
    body |= {"max_tokens": 3, "temperature": 1, "seed": 1}
    chat = "messages" in body
    r = client.post(url, json=body)
    assert r.status_code == 200, r.text
    want = {c["index"]: c["message"]["content"] if chat else c["text"] for c in r.json()["choices"]}
    chunks, _ = sse(client, url, body | {"stream_options": {"include_usage": True,
                                                              "continuous_usage_stats": True}})
    assert choice_texts(chunks, chat) == want and len(set(want.values())) > 1
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == r.json()["usage"]
    done = [ch["usage"]["completion_tokens"] for ch in chunks]
    assert done == sorted(done)
