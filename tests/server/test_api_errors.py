"""Bad requests get 4xx with an OpenAI error body and never a 5xx; back-pressure says 429 / 503.
Runs over the scripted model (fast); schemathesis fuzzes the app's own OpenAPI schema."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from serverkit import ServerThread, script_engine, wait_idle

from tokenhaul.server.app import build_app
from tokenhaul.server.protocol import ErrorResponse

LONG = "word " * 400  # > 256 tokens: the scripted server's context
CMPL, CHAT, TOK, DETOK = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"
USER = [{"role": "user", "content": "hi"}]

BAD = [
    # (path, body, status, param, code)
    (CMPL, b'{"prompt": "x",', 400, None, "invalid_json"),
    (CMPL, b"not json at all", 400, None, "invalid_json"),
    (CMPL, b'{"prompt": "x", "temperature": NaN}', 400, None, "invalid_json"),  # Python's json takes these
    (CMPL, b'{"prompt": "x", "top_p": Infinity}', 400, None, "invalid_json"),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "x": -Infinity}', 400, None,
     "invalid_json"),  # even in a field nothing reads
    (CMPL, [1, 2], 400, None, None),
    (CMPL, {}, 400, "prompt", "missing"),
    (CMPL, {"model": "gpt-17", "prompt": "x"}, 404, "model", "model_not_found"),
    (CMPL, {"prompt": "x", "max_tokens": -1}, 400, "max_tokens", None),
    (CMPL, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", None),
    (CMPL, {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens", "int_type"),
    (CMPL, {"prompt": "x", "max_tokens": 2.5}, 400, "max_tokens", "int_type"),
    (CMPL, {"prompt": 5}, 400, "prompt", "string_type"),  # a union's branch tags are not named
    (CMPL, {"prompt": "x", "temperature": "hot"}, 400, "temperature", "float_type"),
    (CMPL, {"prompt": "x", "temperature": -1}, 400, "temperature", None),
    (CMPL, {"prompt": "x", "top_p": 0}, 400, "top_p", None),
    (CMPL, {"prompt": "x", "stream": "yes"}, 400, "stream", "bool_type"),
    (CMPL, {"prompt": "x", "stop": 3}, 400, "stop", None),
    (CMPL, {"prompt": "x", "stop": ["x"] * 40}, 400, "stop", "too_long"),  # the branch the value's type fits
    (CMPL, {"prompt": "x", "n": 0}, 400, "n", "greater_than_equal"),
    (CMPL, {"prompt": "x", "n": 1000}, 400, "n", "less_than_equal"),
    (CMPL, {"prompt": "x", "logprobs": 50}, 400, "logprobs", None),
    (CMPL, {"prompt": "x", "presence_penalty": 9}, 400, "presence_penalty", None),
    (CMPL, {"prompt": "x", "echo": True, "logprobs": 21}, 400, "logprobs", None),  # echo's k is logprobs'
    (CMPL, {"prompt": "x", "speculative": "medusa"}, 400, None, None),
    (CMPL, {"prompt": "x", "num_speculative_tokens": 99}, 400, None, None),
    (CMPL, {"prompt": "x", "speculative": "draft"}, 400, None, None),  # no draft model: refused at admission
    (CMPL, {"prompt": LONG}, 400, "prompt", "context_length_exceeded"),
    (CMPL, {"prompt": "x", "max_tokens": 256}, 400, "prompt", "context_length_exceeded"),  # 1 + 256 > 256
    (CMPL, {"prompt": [10**9]}, 400, None, None),
    (CMPL, {"prompt": [-3, 5]}, 400, None, None),
    (CMPL, {"prompt": ""}, 400, None, None),
    (CMPL, {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias", None),
    (CMPL, {"prompt": "x", "logit_bias": {"-1": 1}}, 400, "logit_bias", None),
    (CMPL, {"prompt": "x", "logit_bias": {"5": 100.5}}, 400, "logit_bias", None),
    (CMPL, {"prompt": "x", "logit_bias": {"5": "high"}}, 400, None, "float_type"),
    (CMPL, {"prompt": "x", "logit_bias": [5]}, 400, "logit_bias", "dict_type"),
    (CMPL, {"prompt": "x", "logit_bias": {"1000000": 1}}, 400, "logit_bias", None),  # beyond the vocabulary
    (CMPL, {"prompt": []}, 400, None, None),
    (CMPL, {"prompt": "x", "stream": False, "stream_options": {"include_usage": True}}, 400, "stream_options", None),
    (CMPL, {"prompt": ["a", "b"], "n": 70}, 400, None, None),  # 140 choices; at most 128 a call
    (CHAT, {"messages": []}, 400, "messages", "too_short"),
    (CHAT, {"messages": "hi"}, 400, "messages", "list_type"),
    (CHAT, {"messages": [{"content": "hi"}]}, 400, "messages.0.role", "missing"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content", None),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role", "value_error"),  # OpenAI's
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, None, None),
    (CHAT, {"messages": USER, "top_logprobs": 2}, 400, None, None),
    (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", None),
    (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": -1}, 400, "top_logprobs", None),
    (CHAT, {"messages": USER, "stream": False, "stream_options": {}}, 400, "stream_options", None),
    (CHAT, {"messages": USER, "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens", None),
    (CHAT, {"messages": USER, "prompt_logprobs": 21}, 400, "prompt_logprobs", None),  # as logprobs: in [0, 20]
    (CHAT, {"messages": USER, "prompt_logprobs": -1}, 400, "prompt_logprobs", None),
    (CHAT, {"messages": USER, "prompt_logprobs": "1"}, 400, "prompt_logprobs", "int_type"),
    (CHAT, {"messages": USER, "prompt_logprobs": True}, 400, "prompt_logprobs", "int_type"),
    (CHAT, {"messages": USER, "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs", None),  # vLLM's rule
    (CHAT, {"messages": USER, "prompt_logprobs": 1, "use_beam_search": True, "stream": False}, 400,
     "use_beam_search", None),
    (CHAT, {"messages": USER, "echo": True}, 400, "echo", None),  # vLLM extras not served
    (CHAT, {"messages": USER, "guided_whitespace_pattern": " "}, 400, "guided_whitespace_pattern", None),
    (CHAT, {"messages": USER, "guided_choice": []}, 400, "guided_choice", None),  # structured outputs, malformed
    (CHAT, {"messages": USER, "guided_choice": "a"}, 400, "guided_choice", "list_type"),
    (CHAT, {"messages": USER, "structured_outputs": {"regex": "[ab"}}, 400, "structured_outputs", None),
    (CHAT, {"messages": USER, "structured_outputs": {"regex": "a", "choice": ["a"]}}, 400, "structured_outputs",
     None),
    (CHAT, {"messages": USER, "structured_outputs": {"structural_tag": "{}"}}, 400, "structured_outputs", None),
    (CHAT, {"messages": USER, "guided_regex": "a+", "guided_choice": ["a"]}, 400, "guided_choice", None),
    (CHAT, {"messages": USER, "guided_regex": "a+", "speculative": "prompt_lookup"}, 400, "structured_outputs",
     None),
    (CHAT, {"messages": USER, "guided_regex": "a+", "use_beam_search": True}, 400, "structured_outputs", None),
    (CMPL, {"prompt": "x", "guided_json": {"type": "foo"}}, 400, "guided_json", None),
    (CMPL, {"prompt": "x", "guided_json": "{not json"}, 400, "guided_json", None),
    (CMPL, {"prompt": "x", "guided_grammar": "start: ("}, 400, "guided_grammar", None),
    (CMPL, {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "nope"}}}}}}, 400, "response_format", None),
    (CMPL, {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400,
     "response_format", None),
    (CMPL, {"prompt": "x", "response_format": {"type": "xml"}}, 400, "response_format", None),
    (CMPL, {"prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs", None),
    (CMPL, {"prompt": "x", "prompt_logprobs": -1}, 400, "prompt_logprobs", None),
    (CMPL, {"prompt": "x", "prompt_logprobs": -1, "echo": True, "logprobs": 2}, 400, "prompt_logprobs", None),  # not
    # hidden by echo's larger k
    (CMPL, {"prompt": "x", "prompt_logprobs": 2.0}, 400, "prompt_logprobs", "int_type"),
    (CMPL, {"prompt": "x", "prompt_logprobs": [1]}, 400, "prompt_logprobs", "int_type"),
    (CMPL, {"prompt": "x", "prompt_logprobs": 2, "stream": True}, 400, "prompt_logprobs", None),
    (CMPL, {"prompt": "x", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens", None),
    (CMPL, {"prompt": "x", "bad_words": ["no"] * 1025}, 400, "bad_words", "too_long"),
    (CHAT, {"messages": USER, "bad_words": ["no"], "use_beam_search": True}, 400, None, None),
    (CMPL, {"prompt": "x", "use_beam_search": True, "seed": 1}, 400, None, None),  # beams ignore sampling knobs
    (CHAT, {"messages": USER, "use_beam_search": True, "temperature": 1.5}, 400, None, None),
    (CMPL, {"prompt": "x", "guided_whitespace_pattern": " "}, 400, "guided_whitespace_pattern", None),
    (CMPL, {"prompt": "x", "logits_processors": ["m.f"]}, 400, "logits_processors", None),  # vLLM extras not served
    (CHAT, {"messages": USER, "logits_processors": [{"qualname": "m.f"}]}, 400, "logits_processors", None),
    (CMPL, {"prompt": "x", "prompt_embeds": "AAAA"}, 400, "prompt_embeds", None),
    (CMPL, {"prompt": "x", "add_special_tokens": False}, 400, "add_special_tokens", None),  # completions' default: true
    (CHAT, {"messages": USER, "add_special_tokens": True}, 400, "add_special_tokens", None),  # chat's: false
    (CHAT, {"messages": USER, "documents": [{"title": "t", "text": "x"}]}, 400, "documents", None),
    (CMPL, {"prompt": "x", "early_stopping": True, "use_beam_search": True}, 400, "early_stopping", None),
    (CHAT, {"messages": USER, "response_format": {"type": "structural_tag"}}, 400, "response_format", None),
    (CHAT, {"messages": USER, "response_format": {"type": "json_object"}, "guided_regex": "a"}, 400, None, None),
    (CHAT, {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, None, None),  # auto
    (CHAT, {"messages": USER, "tool_choice": "auto"}, 400, "tool_choice", None),  # tool_choice needs tools
    (CHAT, {"messages": USER, "functions": [{"name": "f", "parameters": {}}]}, 400, "functions", None),  # legacy tools
    (CHAT, {"messages": USER, "function_call": {"name": "f"}}, 400, "function_call", None),
    (CHAT, {"messages": USER, "logit_bias": {"5": -101}}, 400, "logit_bias", None),
    (CHAT, {"messages": USER, "logit_bias": {"49152": 1}}, 400, "logit_bias", None),  # SmolLM2: 49152 tokens
    (CHAT, {"messages": USER, "max_completion_tokens": -5}, 400, "max_tokens", None),
    (CHAT, {"messages": [{"role": "user", "content": LONG}]}, 400, "messages", "context_length_exceeded"),
    (CHAT, {"messages": USER, "max_completion_tokens": 250}, 400, "messages", "context_length_exceeded"),
    (CHAT, {"model": "other", "messages": USER}, 404, "model", "model_not_found"),
    (TOK, {"model": "other", "prompt": "x"}, 404, "model", "model_not_found"),
    (TOK, {"model": "other", "messages": USER}, 404, "model", "model_not_found"),
    (DETOK, {"model": "other", "tokens": [1]}, 404, "model", "model_not_found"),
    (TOK, b'{"prompt": "x", "x": NaN}', 400, None, "invalid_json"),
    (TOK, {}, 400, "prompt", "missing"),  # a prompt, or messages
    (TOK, [1], 400, None, None),
    (TOK, {"prompt": 5}, 400, "prompt", "string_type"),
    (TOK, {"prompt": ["x"]}, 400, "prompt", "string_type"),
    (TOK, {"prompt": "x", "add_special_tokens": "yes"}, 400, "add_special_tokens", "bool_type"),
    (TOK, {"prompt": "x", "return_token_strs": 1}, 400, "return_token_strs", "bool_type"),
    (TOK, {"prompt": LONG * 30}, 400, "prompt", "context_length_exceeded"),  # too long to tokenize
    (TOK, {"messages": "hi"}, 400, "messages", "list_type"),
    (TOK, {"prompt": "x", "messages": USER}, 400, None, None),  # which one? refused, not one of them ignored
    (TOK, {"messages": [{"content": "hi"}]}, 400, "messages.0.role", "missing"),
    (TOK, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role", "value_error"),
    (TOK, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, None, None),
    (TOK, {"messages": USER, "continue_final_message": True}, 400, "continue_final_message", None),  # both true
    (TOK, {"messages": USER, "chat_template_kwargs": {"add_generation_prompt": False}}, 400, "chat_template_kwargs",
     None),  # the request's own argument
    (CHAT, {"messages": USER, "chat_template_kwargs": {"messages": []}}, 400, "chat_template_kwargs", None),
    (CHAT, {"messages": USER, "chat_template_kwargs": "x"}, 400, "chat_template_kwargs", "dict_type"),
    (CHAT, {"messages": USER, "chat_template": "{{ 1 }}"}, 400, "chat_template", None),  # not the model's
    (TOK, {"messages": USER, "add_generation_prompt": None}, 400, "add_generation_prompt", "bool_type"),
    (DETOK, {}, 400, "tokens", "missing"),
    (DETOK, {"tokens": 5}, 400, "tokens", "list_type"),
    (DETOK, {"tokens": [1, "2"]}, 400, "tokens.1", "int_type"),
    (DETOK, {"tokens": [1.0]}, 400, "tokens.0", "int_type"),
    (DETOK, {"tokens": [True]}, 400, "tokens.0", "int_type"),
    (DETOK, {"tokens": [5, 49152]}, 400, "tokens", None),  # SmolLM2: 49152 tokens
    (DETOK, {"tokens": [-1]}, 400, "tokens", None),
]


def check_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    ErrorResponse.model_validate(body)
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and "\n" not in err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


@pytest.mark.parametrize("path,body,status,param,code", BAD)
def test_bad_request_is_4xx_with_openai_error(script_server, client, path, body, status, param, code):
    url, engine, _ = script_server
    for stream in (False, True):
        if isinstance(body, bytes):
            r = client.post(url + path, content=body, headers={"content-type": "application/json"})
        else:
            b = body | {"stream": stream} if isinstance(body, dict) and "stream" not in body else body
            r = client.post(url + path, json=b)
        check_error(r, status, param, code)
    assert client.get(url + "/health").status_code == 200
    assert engine.num_unfinished == 0


def test_seed_outside_int64_is_a_400(script_server, client):
    """seed outside int64's [-2**63, 2**63) is a 400 naming it (vLLM's range), not reduced mod 2**63 so that
    2**64 + 5 would silently sample as seed 5; the bounds themselves are served."""
    url, engine, _ = script_server
    for path, body in ((CMPL, {"prompt": "x"}), (CHAT, {"messages": USER})):
        for seed in (2**63, 2**64 + 5, -2**63 - 1):
            err = check_error(client.post(url + path, json=body | {"seed": seed, "max_tokens": 2}), 400, "seed")
            assert "seed" in err["message"], err
        for seed in (2**63 - 1, -2**63):
            r = client.post(url + path, json=body | {"seed": seed, "max_tokens": 2, "temperature": 1, "n": 2})
            assert r.status_code == 200, r.text
    assert engine.num_unfinished == 0


def test_unknown_route_and_method(script_server, client):
    url = script_server[0]
    check_error(client.get(url + "/v1/nothing"), 404)
    check_error(client.get(url + CMPL), 405)


def test_model_by_name(script_server, client):
    """GET /v1/models/{model}: the card /v1/models lists; any other name (one with '/' too, or none) is a 404."""
    url = script_server[0]
    listed = client.get(url + "/v1/models").json()["data"]
    r = client.get(url + "/v1/models/script-model")
    assert r.status_code == 200, r.text
    assert [r.json()] == listed
    for name in ("gpt-17", "org/script-model", ""):
        err = check_error(client.get(url + "/v1/models/" + name), 404, "model", "model_not_found")
        assert f"'{name}'" in err["message"]


def test_head_on_health_and_metrics(script_server, client):
    """Probes may use HEAD: 200 and the GET's headers, no body."""
    url = script_server[0]
    for path in ("/health", "/metrics"):
        r = client.head(url + path)
        assert r.status_code == 200 and r.content == b"", path
        assert r.headers["content-type"] == client.get(url + path).headers["content-type"], path
    assert client.head(url + "/v1/models").status_code == 405  # only the probes


def test_good_request_after_bad_ones(script_server, client):
    url = script_server[0]
    r = client.post(url + CMPL, json={"prompt": "Hello", "max_tokens": 5})
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == 5
    r = client.post(url + CMPL, json={"prompt": "x", "max_tokens": 255, "ignore_eos": True})  # 1 + 255: fits
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 255, r.text
    r = client.post(url + CHAT, json={"messages": USER, "max_tokens": 3, "response_format": {"type": "text"},
                                      "tool_choice": "none", "tools": [], "functions": [], "function_call": "none",
                                      "guided_json": None, "bad_words": [], "some_other_field": 1})
    assert r.status_code == 200, r.text


def test_openai_nullable_fields_null_means_default(script_server, client):
    """OpenAI's schema lets n, stream, echo and (chat) logprobs be null, and SDKs send null for unset fields: the
    default, not a 400; an empty model name is the served model (as vLLM)."""
    url = script_server[0]
    nulls = {"n": None, "stream": None, "logprobs": None, "model": ""}  # "": the served model (vLLM)
    r = client.post(url + CMPL, json={"prompt": "Hello", "max_tokens": 2, "echo": None} | nulls)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1 and r.json()["choices"][0]["logprobs"] is None
    r = client.post(url + CHAT, json={"messages": USER, "max_tokens": 2} | nulls)
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "chat.completion" and r.json()["choices"][0]["logprobs"] is None


def test_queue_full_is_429_with_reason(tokenizer):
    engine, model = script_engine(tokenizer, max_waiting=2, max_num_seqs=1)
    model.delay = 0.05
    with ServerThread(build_app(engine)) as srv, httpx.Client(timeout=60) as c:
        body = {"prompt": "Hello", "max_tokens": 20}
        results: list[httpx.Response] = []
        threads = [threading.Thread(target=lambda: results.append(c.post(srv.url + CMPL, json=body)))
                   for _ in range(2)]
        for t in threads:
            t.start()
        while engine.num_waiting < 1 or engine.num_unfinished < 2:  # both admitted; one waits for the other
            threading.Event().wait(0.005)
        r = c.post(srv.url + CMPL, json=body | {"n": 2})
        err = check_error(r, 429, code="queue_full")
        assert "waiting" in err["message"] and r.headers["retry-after"] == "1"
        for t in threads:
            t.join()
        assert [x.status_code for x in results] == [200, 200]
        assert "tokenhaul_requests_rejected_total{reason=\"queue_full\"} 1.0" in c.get(srv.url + "/metrics").text


def test_refusals_are_counted(tokenizer):
    """Every refused generation call counts in tokenhaul_requests_rejected_total, whichever check refused it."""
    engine, _ = script_engine(tokenizer)
    with ServerThread(build_app(engine)) as srv, httpx.Client(timeout=30) as c:
        bad = [{"prompt": "x", "max_tokens": "five"},  # the body's schema
               {"prompt": "x", "stop": ["x"] * 40},
               {"prompt": "x", "top_k": -5},  # sampling parameters
               {"prompt": "x", "speculative": "draft"},  # admission
               {"prompt": LONG}]
        for body in bad:
            assert c.post(srv.url + CMPL, json=body).status_code == 400
        assert c.post(srv.url + CHAT, json={"messages": USER, "top_logprobs": 2}).status_code == 400
        assert 'tokenhaul_requests_rejected_total{reason="invalid"} 6.0' in c.get(srv.url + "/metrics").text


def test_engine_down_is_503(tokenizer):
    engine, _ = script_engine(tokenizer)
    with ServerThread(build_app(engine)) as srv, httpx.Client(timeout=30) as c:
        assert c.get(srv.url + "/health").status_code == 200
        engine.client.core_thread.shutdown()
        check_error(c.get(srv.url + "/health"), 503, code="engine_unavailable")
        check_error(c.post(srv.url + CMPL, json={"prompt": "x"}), 503, code="engine_unavailable")


# schemathesis: fuzz every operation against the schema the app publishes ---------------------------
# (schemathesis' pytest plugin trips over pytest 9's node ids, so its strategies are used directly)
@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_schemathesis(script_server, mode):
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        negative_data_rejection,
        response_schema_conformance,
        status_code_conformance,
    )

    url, engine, _ = script_server
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    if mode == "negative":
        checks.append(negative_data_rejection)

    @given(case=schema.as_strategy(GenerationMode(mode)))
    # derandomized: the same examples every run, so CI cannot fail by the luck of the draw (hunt with more
    # examples and random seeds by hand: one such hunt found the 413 case below)
    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None,
              derandomize=True)
    def fuzz(case):
        b = case.body
        if isinstance(b, dict):  # keep generation short: non-greedy sampling is slow on a busy CPU
            for k, cap in (("max_tokens", 4), ("max_completion_tokens", 4), ("n", 2)):
                if isinstance(b.get(k), int) and not isinstance(b.get(k), bool):
                    b[k] = min(b[k], cap)
            if not isinstance(b.get("max_completion_tokens"), int):
                b.setdefault("max_tokens", 4)
        r = case.call(base_url=url, timeout=60)
        if r.status_code == 413:  # the body-size guard refuses first (more than --max-body-bytes): a rejection too,
            ErrorResponse.model_validate(json.loads(r.text))  # though ST201's list of rejecting codes lacks 413
            return
        case.validate_response(r, checks=checks)
        if r.status_code >= 400:
            ErrorResponse.model_validate(json.loads(r.text))

    fuzz()
    wait_idle(engine)
    assert httpx.get(url + "/health").status_code == 200
