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
