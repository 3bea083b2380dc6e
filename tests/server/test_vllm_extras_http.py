"""vLLM's request semantics the HTTP server follows: max_tokens null (up to the context's end), n up to MAX_N, the
/ping and /version routes, and the sampling extras allowed_token_ids, bad_words and truncate_prompt_tokens."""

from __future__ import annotations

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
