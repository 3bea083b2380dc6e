"""vLLM's request semantics the HTTP server follows: max_tokens null (up to the context's end), n up to MAX_N, the
/ping and /version routes, and the sampling extras allowed_token_ids, bad_words and truncate_prompt_tokens."""

from __future__ import annotations

import json

import pytest

CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "x"}]


def test_script_max_tokens_null_runs_to_the_context_end(script_server, client):
    """An explicit max_tokens null (vLLM's SamplingParams(max_tokens=None)): as many tokens as the context holds
    after the prompt (a prompt of ids too); left out, completions' default 16. Chat: null or absent, both
    max_tokens and max_completion_tokens, up to the context's end."""
    url, engine, _ = script_server
    ctx = engine.limits.max_model_len
    for prompt in ("Hi there", [1, 2, 3, 4, 5]):
        r = client.post(url + CMPL, json={"prompt": prompt, "max_tokens": None, "ignore_eos": True})
        assert r.status_code == 200, r.text
        u = r.json()["usage"]
        assert u["total_tokens"] == ctx and r.json()["choices"][0]["finish_reason"] == "length", u
    r = client.post(url + CMPL, json={"prompt": "Hi there", "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 16
    for extra in ({}, {"max_tokens": None}, {"max_completion_tokens": None},
                  {"max_tokens": None, "max_completion_tokens": None}):
        r = client.post(url + CHAT, json={"messages": USER, "ignore_eos": True} | extra)
        assert r.status_code == 200 and r.json()["usage"]["total_tokens"] == ctx, (extra, r.text)


def test_script_n_up_to_max_n(script_server, client):
    """n up to SamplingParams' MAX_N (128, OpenAI's cap), as the CLI and LLM take it: 128 choices served, streamed
    or not, on completions and chat, though the KV pool holds only some at once; n=129 is a 400 naming the cap."""
    from tokenhaul.sampling_params import MAX_N

    url, engine, _ = script_server
    for path, body in ((CMPL, {"prompt": "Hi"}), (CHAT, {"messages": USER})):
        body |= {"n": MAX_N, "max_tokens": 3, "temperature": 1, "seed": 3}
        r = client.post(url + path, json=body)
        assert r.status_code == 200, r.text
        assert [c["index"] for c in r.json()["choices"]] == list(range(MAX_N))
        assert r.json()["usage"]["completion_tokens"] == 3 * MAX_N
        with client.stream("POST", url + path, json=body | {"stream": True}) as s:
            assert s.status_code == 200
            finished = sum('"finish_reason":"length"' in ln for ln in s.iter_lines())
        assert finished == MAX_N
        r = client.post(url + path, json=body | {"n": MAX_N + 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
        assert str(MAX_N) in r.json()["error"]["message"]
    r = client.post(url + CMPL, json={"prompt": ["a", "b"], "n": MAX_N, "max_tokens": 1})
    assert r.status_code == 400 and f"at most {MAX_N}" in r.json()["error"]["message"], r.text
    assert engine.num_unfinished == 0


def test_script_many_choices_at_once_are_served_or_refused(tokenizer):
    """Calls of 128 choices at once beyond the waiting queue's room: each one served whole or refused whole (429),
    and the server serves on."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from serverkit import ServerThread, script_engine

    from tokenhaul.server.app import build_app

    engine, _ = script_engine(tokenizer, max_waiting=300)
    body = {"prompt": "Hi", "n": 128, "max_tokens": 4}
    with ServerThread(build_app(engine)) as srv, httpx.Client(timeout=120) as c:
        with ThreadPoolExecutor(4) as pool:
            rs = list(pool.map(lambda _: c.post(srv.url + CMPL, json=body), range(4)))
        codes = sorted(r.status_code for r in rs)
        assert set(codes) <= {200, 429} and 200 in codes, codes
        for r in rs:
            if r.status_code == 200:
                assert len(r.json()["choices"]) == 128 and r.json()["usage"]["completion_tokens"] == 512
        assert c.post(srv.url + CMPL, json=body).status_code == 200
        assert c.get(srv.url + "/health").status_code == 200


def test_script_more_choices_than_the_waiting_queue_is_a_400(tokenizer):
    """A call of more engine requests than --max-waiting could ever admit is a 400 saying so, not a 429 whose
    retry could never succeed."""
    import httpx
    from serverkit import ServerThread, script_engine

    from tokenhaul.server.app import build_app

    engine, _ = script_engine(tokenizer, max_waiting=8)
    with ServerThread(build_app(engine)) as srv, httpx.Client(timeout=60) as c:
        r = c.post(srv.url + CMPL, json={"prompt": "Hi", "n": 9, "max_tokens": 2})
        assert r.status_code == 400 and "max-waiting" in r.json()["error"]["message"], r.text
        assert c.post(srv.url + CMPL, json={"prompt": "Hi", "n": 8, "max_tokens": 2}).status_code == 200


def test_ping_and_version(tokenizer):
    """vLLM's GET/POST /ping (a health probe: 200, 503 when the engine is down) is answered without the API key as
    /health is; GET /version gives tokenhaul's version (behind the key, as every other route)."""
    from importlib.metadata import version

    import httpx
    from serverkit import ServerThread, script_engine

    from tokenhaul.server.app import build_app
    from tokenhaul.server.guards import ServerOptions

    engine, _ = script_engine(tokenizer)
    with ServerThread(build_app(engine, ServerOptions(api_key="k"))) as srv, httpx.Client(timeout=30) as c:
        for method in ("GET", "POST", "HEAD"):
            assert c.request(method, srv.url + "/ping").status_code == 200, method
        assert c.get(srv.url + "/version").status_code == 401
        r = c.get(srv.url + "/version", headers={"Authorization": "Bearer k"})
        assert r.status_code == 200 and r.json() == {"version": version("tokenhaul")}, r.text
        engine.client.core_thread.shutdown()
        assert c.get(srv.url + "/ping").status_code == 503


PROMPT = "The capital of France is"


def sse(client, url: str, body: dict) -> list[dict]:
    with client.stream("POST", url, json=body | {"stream": True}) as r:
        assert r.status_code == 200, r.read()
        data = [ln[len("data: "):] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def greedy(client, url: str, body: dict) -> dict:
    r = client.post(url, json={"max_tokens": 8, "temperature": 0} | body)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.real_model
def test_real_bad_words_ban_what_smollm_writes(real_server, client):
    """vLLM's bad_words: a word SmolLM2 writes greedily is never written once banned, on completions and chat
    (streamed too), n > 1 alike."""
    url = real_server[0]
    text = greedy(client, url + CMPL, {"prompt": PROMPT})["choices"][0]["text"]
    word = next(w.strip(".,") for w in text.split() if len(w.strip(".,")) > 2)
    assert word in text
    banned = greedy(client, url + CMPL, {"prompt": PROMPT, "bad_words": [word], "n": 2})
    for c in banned["choices"]:
        assert word not in c["text"] and c["text"], c
    chunks = sse(client, url + CMPL, {"prompt": PROMPT, "bad_words": [word], "max_tokens": 8, "temperature": 0})
    assert "".join(c["text"] for ch in chunks for c in ch["choices"]) == banned["choices"][0]["text"]
    msgs = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    said = greedy(client, url + CHAT, {"messages": msgs})["choices"][0]["message"]["content"]
    word = next(w.strip(".,!") for w in said.split() if len(w.strip(".,!")) > 2)
    said = greedy(client, url + CHAT, {"messages": msgs, "bad_words": [word]})["choices"][0]["message"]["content"]
    assert word not in said and said


@pytest.mark.real_model
def test_real_allowed_token_ids_restrict_every_token(real_server, client, tokenizer):
    """vLLM's allowed_token_ids: every generated token is one of them (sampled too); an id outside the vocabulary
    is a 400 naming the field, before anything runs."""
    url, engine = real_server
    allowed = sorted(set(tokenizer.encode(" the cat sat on a mat and", add_special_tokens=False)))
    shown = {tokenizer.decode([t], skip_special_tokens=False) for t in allowed}
    for body in ({"temperature": 0}, {"temperature": 1.5, "seed": 4, "n": 3}):
        r = greedy(client, url + CMPL, {"prompt": PROMPT, "allowed_token_ids": allowed, "logprobs": 0,
                                        "ignore_eos": True} | body)
        for c in r["choices"]:
            assert len(c["logprobs"]["tokens"]) == 8 and set(c["logprobs"]["tokens"]) <= shown, c
    r = greedy(client, url + CHAT, {"messages": USER, "allowed_token_ids": allowed, "logprobs": True,
                                    "ignore_eos": True})
    assert {e["token"] for e in r["choices"][0]["logprobs"]["content"]} <= shown
    for path, body in ((CMPL, {"prompt": PROMPT}), (CHAT, {"messages": USER})):
        for bad in ([engine.limits.vocab_size], [-1], []):
            r = client.post(url + path, json=body | {"allowed_token_ids": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids", r.text
    assert engine.num_unfinished == 0


@pytest.mark.real_model
def test_real_truncate_prompt_tokens_runs_the_last_k(real_server, client, tokenizer):
    """vLLM's truncate_prompt_tokens: the same output as sending the prompt's last k token ids (completions: a text
    prompt or ids; chat: of the rendered prompt), usage counting k prompt tokens; echo shows what was run."""
    url = real_server[0]
    ids = tokenizer.encode("Some words first, then: " + PROMPT)
    want = greedy(client, url + CMPL, {"prompt": ids[-6:]})
    for prompt in ("Some words first, then: " + PROMPT, ids):
        got = greedy(client, url + CMPL, {"prompt": prompt, "truncate_prompt_tokens": 6})
        assert got["choices"][0]["text"] == want["choices"][0]["text"] and got["usage"] == want["usage"]
        assert got["usage"]["prompt_tokens"] == 6
    echo = greedy(client, url + CMPL, {"prompt": "Some words first, then: " + PROMPT, "truncate_prompt_tokens": 6,
                                       "echo": True, "logprobs": 0})
    c = echo["choices"][0]
    assert c["text"] == tokenizer.decode(ids[-6:]) + want["choices"][0]["text"]
    assert len(c["logprobs"]["tokens"]) == 6 + 8 and c["logprobs"]["text_offset"][6] == len(tokenizer.decode(ids[-6:]))
    msgs = [{"role": "user", "content": "Tell me about Paris."}]
    rendered = client.post(url + "/tokenize", json={"messages": msgs}).json()["tokens"]
    want = greedy(client, url + CMPL, {"prompt": rendered[-9:]})
    got = greedy(client, url + CHAT, {"messages": msgs, "truncate_prompt_tokens": 9})
    assert got["choices"][0]["message"]["content"] == want["choices"][0]["text"]
    assert got["usage"] == want["usage"] and got["usage"]["prompt_tokens"] == 9
    whole = greedy(client, url + CMPL, {"prompt": PROMPT})
    got = greedy(client, url + CMPL, {"prompt": PROMPT, "truncate_prompt_tokens": -1})  # -1: the context's length
    assert (got["choices"], got["usage"]) == (whole["choices"], whole["usage"])
    r = client.post(url + CMPL, json={"prompt": PROMPT, "truncate_prompt_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text


def test_script_extras_at_their_default_are_served(script_server, client):
    """vLLM's extras tokenhaul refuses when set (they would change the output) are served at vLLM's defaults, as if
    left out: add_special_tokens true on completions and false on chat, empty logits_processors, null documents."""
    url = script_server[0]
    for path, body in ((CMPL, {"prompt": "Hi", "add_special_tokens": True, "logits_processors": []}),
                       (CHAT, {"messages": USER, "add_special_tokens": False, "documents": None,
                               "early_stopping": False})):
        r = client.post(url + path, json=body | {"max_tokens": 2})
        assert r.status_code == 200, r.text


def token_id(name: str) -> int:
    """The id in a return_tokens_as_token_ids name, "token_id:N"."""
    head, _, tail = name.partition(":")
    assert head == "token_id" and tail.isdigit(), name
    return int(tail)


def test_script_return_tokens_as_token_ids_names_every_logprob_token(script_server, client, tokenizer):
    """vLLM's return_tokens_as_token_ids: every logprobs token is "token_id:N" (the sampled ones, their
    top_logprobs, echo's prompt tokens), on completions and chat, streamed or not; tokens whose text is the same
    ("\\ufffd" for each byte of a character) stay apart. Chat's bytes are still the token's own."""
    url = script_server[0]
    body = {"prompt": "Hi", "max_tokens": 12, "logprobs": 3, "return_tokens_as_token_ids": True}
    for extra in ({}, {"echo": True}):
        c = client.post(url + CMPL, json=body | extra).json()["choices"][0]
        lp = c["logprobs"]
        ids = [token_id(t) for t in lp["tokens"]]
        assert tokenizer.decode(ids) == c["text"]
        for t, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
            if v is None:  # echo: the prompt's first token
                continue
            assert len(top) in (3, 4) and top[t] == v and all(token_id(k) >= 0 for k in top), top
        chunks = sse(client, url + CMPL, body | extra)
        assert [t for ch in chunks for c in ch["choices"] for t in (c["logprobs"] or {}).get("tokens", [])] == \
            lp["tokens"]
        plain = client.post(url + CMPL, json=body | extra | {"return_tokens_as_token_ids": False}).json()
        assert plain["choices"][0]["logprobs"]["tokens"] == [tokenizer.decode([t], skip_special_tokens=False)
                                                             for t in ids]
    assert any(tokenizer.decode([t]) == "\ufffd" for t in ids)  # the script writes CJK and emoji: byte fragments
    chat = {"messages": USER, "max_tokens": 12, "logprobs": True, "top_logprobs": 2, "return_tokens_as_token_ids": True}
    got = client.post(url + CHAT, json=chat).json()["choices"][0]
    entries = got["logprobs"]["content"]
    ids = [token_id(e["token"]) for e in entries]
    assert tokenizer.decode(ids) == got["message"]["content"]
    for e in entries:
        assert bytes(e["bytes"]) == tokenizer.token_bytes(token_id(e["token"]))
        assert len(e["top_logprobs"]) == 2 and all(token_id(t["token"]) >= 0 for t in e["top_logprobs"])
    chunks = sse(client, url + CHAT, chat)
    assert [e for ch in chunks for c in ch["choices"] for e in (c["logprobs"] or {}).get("content", [])] == entries


def test_script_return_token_ids_gives_the_prompt_and_output_ids(script_server, client, tokenizer):
    """vLLM's return_token_ids: completions' choices carry their prompt's token ids (prompt_token_ids: as run, after
    truncate_prompt_tokens) and their own (token_ids); chat's response the prompt's, each choice its own. Streamed:
    the prompt's with each choice's first chunk, each chunk the ids it adds. Left out: neither."""
    url = script_server[0]
    prompts = ["Hi there", "Something else"]
    body = {"prompt": prompts, "n": 2, "max_tokens": 9, "return_token_ids": True}
    got = client.post(url + CMPL, json=body).json()
    for c in got["choices"]:
        assert c["prompt_token_ids"] == tokenizer.encode(prompts[c["index"] // 2]), c
        assert len(c["token_ids"]) == 9 and tokenizer.decode(c["token_ids"]) == c["text"], c
    streamed: dict[int, dict] = {}
    for ch in sse(client, url + CMPL, body):
        for c in ch["choices"]:
            s = streamed.setdefault(c["index"], {"token_ids": []})
            if "prompt_token_ids" in c:
                assert "prompt_token_ids" not in s and not s["token_ids"], c  # once, with the first chunk
                s["prompt_token_ids"] = c["prompt_token_ids"]
            s["token_ids"] += c["token_ids"]
    assert [streamed[c["index"]] for c in got["choices"]] == [
        {"prompt_token_ids": c["prompt_token_ids"], "token_ids": c["token_ids"]} for c in got["choices"]]
    cut = client.post(url + CMPL, json=body | {"truncate_prompt_tokens": 1}).json()
    assert [c["prompt_token_ids"] for c in cut["choices"]] == [tokenizer.encode(p)[-1:] for p in prompts for _ in "ab"]
    for extra in ({"echo": True, "max_tokens": 0}, {"echo": True, "max_tokens": 0, "logprobs": 1}, {"echo": True}):
        whole = client.post(url + CMPL, json=body | extra).json()["choices"]  # echo: token_ids are the output's
        chunks = [c for ch in sse(client, url + CMPL, body | extra) for c in ch["choices"]]
        for c in whole:
            assert c["prompt_token_ids"] == tokenizer.encode(prompts[c["index"] // 2]), (extra, c)
            assert len(c["token_ids"]) == extra.get("max_tokens", 9), (extra, c)
            mine = [s for s in chunks if s["index"] == c["index"]]
            assert mine[0]["prompt_token_ids"] == c["prompt_token_ids"] and all(
                "prompt_token_ids" not in s for s in mine[1:]), (extra, mine)
            assert [t for s in mine for t in s["token_ids"]] == c["token_ids"], (extra, mine)
    plain = client.post(url + CMPL, json=body | {"return_token_ids": False}).json()
    assert not {"prompt_token_ids", "token_ids"} & set(plain["choices"][0])
    chat = {"messages": USER, "n": 2, "max_tokens": 9, "return_token_ids": True}
    rendered = client.post(url + "/tokenize", json={"messages": USER}).json()["tokens"]
    got = client.post(url + CHAT, json=chat).json()
    assert got["prompt_token_ids"] == rendered
    for c in got["choices"]:
        assert len(c["token_ids"]) == 9 and tokenizer.decode(c["token_ids"]) == c["message"]["content"], c
    chunks = sse(client, url + CHAT, chat)
    # the first chunk of each choice (its role; vLLM's), and no other
    assert [ch.get("prompt_token_ids") for ch in chunks] == [rendered] * 2 + [None] * (len(chunks) - 2)
    assert [ch["choices"][0]["delta"].get("role") for ch in chunks[:2]] == ["assistant"] * 2
    for c in got["choices"]:
        assert [t for ch in chunks for s in ch["choices"] if s["index"] == c["index"]
                for t in s.get("token_ids", [])] == c["token_ids"]
