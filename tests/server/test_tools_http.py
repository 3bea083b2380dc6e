"""Tool calling over HTTP with the official openai client. On SmolLM2-135M (its template ignores tools): a named
function's arguments and "required"'s calls follow their schemas, "none" answers text, streamed as non-streamed, and
the 400s ("auto" without --enable-auto-tool-choice, bad tools, a tool_choice naming no tool). On a scripted model
with Qwen2.5's tokenizer and template, served with the hermes parser: the template gets the tools (with "none" too,
as vLLM's default), and "auto" reads <tool_call> blocks from the text, streamed as non-streamed."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest
import torch
from serverkit import MODEL, ScriptModel, ServerThread

from tokenhaul.config import EngineConfig
from tokenhaul.engine.core import EngineCore
from tokenhaul.server.app import build_app
from tokenhaul.server.async_engine import AsyncEngine
from tokenhaul.server.chat_protocol import ChatMessage
from tokenhaul.server.guards import ServerOptions
from tokenhaul.server.tools import read_tool_use
from tokenhaul.text.tokenizer import Tokenizer

pytestmark = pytest.mark.real_model

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "maxLength": 12}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time now",
                                           "parameters": {"type": "object", "properties": {}}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def oai(real_server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=real_server[0] + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def _streamed(chunks: list, choice: int = 0) -> tuple[str, list[tuple[str | None, str | None, str]], str | None]:
    """(content, [(id, name, arguments)], finish_reason) of one choice as a client accumulates a stream's deltas."""
    content, calls, reason = "", {}, None
    for c in chunks:
        for ch in c.choices:
            if ch.index != choice:
                continue
            content += ch.delta.content or ""
            for t in ch.delta.tool_calls or []:
                slot = calls.setdefault(t.index, [t.id, t.function.name, ""])
                slot[2] += t.function.arguments or ""
            reason = ch.finish_reason or reason
    return content, [tuple(v) for v in calls.values()], reason


def _argument_pieces(chunks: list) -> dict[tuple[int, int], int]:
    """(choice index, call index) -> how many deltas carried a piece of the call's arguments."""
    pieces: dict[tuple[int, int], int] = {}
    for c in chunks:
        for ch in c.choices:
            for t in ch.delta.tool_calls or []:
                pieces[ch.index, t.index] = pieces.get((ch.index, t.index), 0) + bool(t.function.arguments)
    return pieces


def _calls(message) -> list[tuple[str, str, str]]:
    return [(t.id, t.function.name, t.function.arguments) for t in message.tool_calls or []]


def test_named_function_arguments_follow_its_schema_streamed_the_same(oai):
    kw = dict(model=MODEL, messages=ASK, max_tokens=40, temperature=0, tools=TOOLS, tool_choice=NAMED)
    r = oai.chat.completions.create(**kw)
    choice = r.choices[0]
    (call_id, name, args), = _calls(choice.message)
    assert call_id.startswith("chatcmpl-tool-") and name == "get_weather" and choice.message.tool_calls[0].type
    jsonschema.validate(json.loads(args), WEATHER)
    assert choice.message.content == "" and choice.finish_reason == "stop"  # vLLM's and OpenAI's for a named call
    content, calls, reason = _streamed(list(oai.chat.completions.create(**kw, stream=True)))
    assert content == "" and reason == "stop"
    assert [(n, a) for _, n, a in calls] == [(name, args)] and calls[0][0].startswith("chatcmpl-tool-")


def test_required_calls_name_given_tools_streamed_the_same(oai):
    kw = dict(model=MODEL, messages=ASK, max_tokens=120, temperature=0, tools=TOOLS, tool_choice="required")
    r = oai.chat.completions.create(**kw)
    choice = r.choices[0]
    calls = _calls(choice.message)
    assert calls and choice.finish_reason == "tool_calls" and choice.message.content == ""
    for call_id, name, args in calls:
        assert call_id.startswith("chatcmpl-tool-")
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)
        jsonschema.validate(json.loads(args), schema)
    content, streamed, reason = _streamed(list(oai.chat.completions.create(**kw, stream=True)))
    assert (content, reason) == ("", "tool_calls")
    assert [(n, a) for _, n, a in streamed] == [(n, a) for _, n, a in calls]


def test_required_streams_each_calls_arguments_piecewise_for_every_choice(oai):
    """As vLLM: a call's first delta has its index, id, type and name, later ones pieces of its arguments, which add
    up to the non-streamed arguments; with n = 2 each choice's call is its call 0."""
    kw = dict(model=MODEL, messages=ASK, max_tokens=200, temperature=0, tools=TOOLS[:1], tool_choice="required")
    calls = _calls(oai.chat.completions.create(**kw).choices[0].message)  # SmolLM2 writes them spaced over lines
    assert calls and all(args != "{}" for _, _, args in calls)
    chunks = list(oai.chat.completions.create(**kw, n=2, stream=True))
    for choice in (0, 1):
        content, streamed, reason = _streamed(chunks, choice)
        assert (content, reason) == ("", "tool_calls") and [(n, a) for _, n, a in streamed] == [
            (n, a) for _, n, a in calls]
        assert all(call_id.startswith("chatcmpl-tool-") for call_id, _, _ in streamed)
    pieces = _argument_pieces(chunks)
    assert set(pieces) == {(i, k) for i in (0, 1) for k in range(len(calls))} and min(pieces.values()) > 1, pieces


def test_required_cut_short_streams_what_the_message_holds(oai):
    """max_tokens ends a "required" call midway: streamed and not, the call as far as it came and finish_reason
    length, never its raw text as content besides (the stream sent the call before it knew it would end short)."""
    kw = dict(model=MODEL, messages=ASK, max_tokens=12, temperature=0, tools=TOOLS, tool_choice="required")
    choice = oai.chat.completions.create(**kw).choices[0]
    calls = _calls(choice.message)
    assert calls and choice.finish_reason == "length" and not choice.message.content
    content, streamed, reason = _streamed(list(oai.chat.completions.create(**kw, stream=True)))
    assert (content, reason) == ("", "length") and [(n, a) for _, n, a in streamed] == [(n, a) for _, n, a in calls]


def test_none_answers_text(oai):
    kw = dict(model=MODEL, messages=ASK, max_tokens=8, temperature=0)
    plain = oai.chat.completions.create(**kw)
    r = oai.chat.completions.create(**kw, tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content == plain.choices[0].message.content
    assert r.choices[0].finish_reason == plain.choices[0].finish_reason


@pytest.mark.parametrize("extra, param", [
    ({"tools": TOOLS}, None),  # "auto", the default with tools, needs --enable-auto-tool-choice
    ({"tools": TOOLS, "tool_choice": "auto"}, None),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 5}}], "tool_choice": "required"},
     "tools"),
    ({"tools": [{"type": "code_interpreter"}], "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools"),  # not a JSON schema
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_stock"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tools"),
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),  # the legacy form stays refused
])
def test_refusals(oai, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, extra_body=extra)
    body = e.value.body
    assert body["param"] == param
    if param is None:
        assert body["message"] == '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser ' \
                                  'to be set'


# SmolLM2 served with the hermes parser; a regex has it write a <tool_call> block, spacing its arguments as it likes
HERMES = (r'Let me check\.\n<tool_call>\n\{"name": "get_weather", "arguments": ?\{ ?"city" ?: ?"[A-Z][a-z]{2,11}" ?'
          r'\}\}\n</tool_call>')


@pytest.fixture(scope="module")
def hermes_oai(smollm) -> Iterator[openai.OpenAI]:
    cfg = EngineConfig(model=MODEL, dtype="fp32", num_kv_blocks=128, max_num_seqs=8)
    engine = AsyncEngine(EngineCore(cfg, smollm.model), smollm.tokenizer, MODEL)
    options = ServerOptions(enable_auto_tool_choice=True, tool_call_parser="hermes")
    with ServerThread(build_app(engine, options)) as srv, \
            openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def test_auto_streams_a_hermes_calls_arguments_piecewise(hermes_oai):
    kw = dict(model=MODEL, messages=ASK, max_tokens=60, temperature=0, tools=TOOLS,
              extra_body={"structured_outputs": {"regex": HERMES}})
    message = hermes_oai.chat.completions.create(**kw).choices[0].message
    (_, name, args), = _calls(message)
    assert name == "get_weather" and message.content == "Let me check.\n" and json.loads(args)["city"]
    chunks = list(hermes_oai.chat.completions.create(**kw, stream=True))
    content, streamed, reason = _streamed(chunks)
    assert (content, reason) == ("Let me check.\n", "tool_calls") and [(n, a) for _, n, a in streamed] == [
        (name, args)]  # the pieces add up to the non-streamed arguments: no tag, no name, no JSON around them
    assert _argument_pieces(chunks)[0, 0] > 1


# Qwen2.5's template renders tools; a scripted model answers what each test sets -------------------------------
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def qwen() -> Iterator[tuple[openai.OpenAI, ScriptModel, list[int], Tokenizer, str]]:
    from tokenhaul.models.catalog import is_installed, resolve

    if not is_installed("qwen2.5-coder-0.5b"):
        pytest.skip("model qwen2.5-coder-0.5b not installed")
    f = resolve("qwen2.5-coder-0.5b")
    tok = Tokenizer.from_gguf(f.gguf_path, f.cache_dir, "qwen2.5-coder-0.5b")
    model = ScriptModel(tok.vocab_size, [0])
    core = EngineCore(EngineConfig(model="script", num_kv_blocks=64, block_size=16, max_model_len=1024,
                                   max_num_seqs=4, max_num_batched_tokens=1024), model)
    engine = AsyncEngine(core, tok, "qwen-script", 16)
    options = ServerOptions(enable_auto_tool_choice=True, tool_call_parser="hermes")
    with ServerThread(build_app(engine, options)) as srv, \
            openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c, model, [*tok.encode(CALL, add_special_tokens=False), tok.eos_token_ids[0]], tok, srv.url


def test_the_template_gets_the_tools_also_with_none(qwen):
    oai, url = qwen[0], qwen[4]
    sizes = {choice: oai.chat.completions.create(model="qwen-script", messages=ASK, max_tokens=1, **kw).usage
             .prompt_tokens for choice, kw in (("no tools", {}), ("none", {"tools": TOOLS, "tool_choice": "none"}),
                                               ("auto", {"tools": TOOLS}))}
    assert sizes["none"] == sizes["auto"] > sizes["no tools"] + 50
    r = httpx.post(url + "/tokenize", json={"messages": ASK, "tools": TOOLS})  # vLLM's /tokenize renders them too
    assert r.json()["count"] == sizes["auto"]
    r = httpx.post(url + "/tokenize", json={"messages": ASK, "tools": [{"type": "function"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


def test_serve_can_leave_the_tools_out_with_none(qwen):
    """serve --exclude-tools-when-tool-choice-none (vLLM's): tool_choice "none" renders no tools, "auto" does."""
    from tokenhaul.cli import build_parser

    tok = qwen[3]
    core = EngineCore(EngineConfig(model="script", num_kv_blocks=64, block_size=16, max_model_len=1024,
                                   max_num_seqs=4, max_num_batched_tokens=1024), ScriptModel(tok.vocab_size, [0]))
    flags = build_parser().parse_args(["serve", "--exclude-tools-when-tool-choice-none"])
    assert flags.exclude_tools_when_tool_choice_none
    options = ServerOptions(enable_auto_tool_choice=True, tool_call_parser="hermes",
                            exclude_tools_when_tool_choice_none=True)
    with ServerThread(build_app(AsyncEngine(core, tok, "qwen-script", 16), options)) as srv, \
            openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        sizes = {choice: c.chat.completions.create(model="qwen-script", messages=ASK, max_tokens=1, **kw).usage
                 .prompt_tokens for choice, kw in (("no tools", {}), ("none", {"tools": TOOLS, "tool_choice": "none"}),
                                                   ("auto", {"tools": TOOLS}))}
    assert sizes["none"] == sizes["no tools"] and sizes["auto"] > sizes["no tools"] + 50


def test_auto_reads_hermes_tool_calls_streamed_the_same(qwen):
    oai, model, reply, tok, _ = qwen
    kw = dict(model="qwen-script", messages=ASK, max_tokens=64, tools=TOOLS)
    n = oai.chat.completions.create(**kw | {"max_tokens": 1}).usage.prompt_tokens
    model.script = torch.tensor([0] * n + reply)  # the answer, from the first generated position
    r = oai.chat.completions.create(**kw)
    choice = r.choices[0]
    (call_id, name, args), = _calls(choice.message)
    assert call_id.startswith("chatcmpl-tool-") and (name, json.loads(args)) == ("get_weather", {"city": "Paris"})
    assert choice.message.content is None and choice.finish_reason == "tool_calls"
    content, calls, reason = _streamed(list(oai.chat.completions.create(**kw, stream=True)))
    assert (content, reason) == ("", "tool_calls") and [(n, a) for _, n, a in calls] == [(name, args)]
    # the call and its result in the history reach the template as vLLM passes them (arguments as an object),
    # and an answer without a block is text
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "18 C, sunny"}]
    kw["messages"] = history
    n = oai.chat.completions.create(**kw | {"max_tokens": 1}).usage.prompt_tokens
    text = tok.apply_chat_template([ChatMessage.model_validate(m).as_template_dict() for m in history], True, False,
                                   {"tools": read_tool_use(TOOLS, None, "hermes").tools})
    assert n == len(tok.encode(text, add_special_tokens=False))
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in text
    model.script = torch.tensor([0] * n + reply[-2:])  # "</tool_call>" then the end of turn
    r = oai.chat.completions.create(**kw)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == "</tool_call>"
