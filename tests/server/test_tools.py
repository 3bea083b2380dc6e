"""server/tools.py without a server: tools and tool_choice checked as vLLM checks them, the JSON schemas of a named
and a "required" choice, the assistant messages read from the text (named, required, hermes for auto), the streamed
deltas adding up to the message, and chat history's tool calls as the template gets them."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tokenhaul.errors import RequestError, TokenhaulError
from tokenhaul.server.chat_protocol import ChatMessage
from tokenhaul.server.guards import ServerOptions
from tokenhaul.server.tool_stream import ToolStream, choice_message
from tokenhaul.server.tools import AUTO_REFUSED, ToolUse, parse_hermes, read_tool_use

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "the weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now"}}]


def test_tool_choice_kinds_and_the_template_tools():
    assert read_tool_use(None, None, None) is None
    use = read_tool_use(TOOLS, "none", None)
    assert use.choice == "none" and use.tools[1] == {"type": "function", "function": {
        "name": "now", "description": None, "parameters": None}}  # vLLM's model_dump: every field
    assert read_tool_use(TOOLS, None, "hermes").choice == "auto"  # the default with tools
    assert read_tool_use(TOOLS, "required", None).choice == "required"
    assert read_tool_use([], "required", None).choice == "none"  # OpenAI's: no tools to require
    named = read_tool_use(TOOLS, {"type": "function", "function": {"name": "weather"}}, None)
    assert (named.choice, named.name, named.schema()) == ("named", "weather", WEATHER)
    assert read_tool_use(TOOLS, {"function": {"name": "now"}}, None).name == "now"  # type defaults to function


@pytest.mark.parametrize("tools, choice, param", [
    (TOOLS, None, None),  # auto without the server's parser
    (TOOLS, "auto", None),
    (None, "required", "tool_choice"),
    (TOOLS, "sometimes", "tool_choice"),
    (TOOLS, {"type": "function", "function": {"name": "missing"}}, "tool_choice"),
    (TOOLS, {"type": "function"}, "tool_choice"),
    (TOOLS, {"type": "retrieval", "function": {"name": "now"}}, "tool_choice"),
    ([{"type": "retrieval"}], "required", "tools"),
    (["weather"], "required", "tools"),
    ([{"type": "function", "function": {"description": "no name"}}], "required", "tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], "required", "tools"),
    ([{"type": "function", "function": {"name": "f", "description": 5}}], "none", "tools"),
])
def test_bad_tools_and_tool_choices_are_refused_by_name(tools, choice, param):
    with pytest.raises(RequestError) as e:
        read_tool_use(tools, choice, None)
    msg = str(e.value)
    assert msg.startswith(f"{param}: ") if param else msg == AUTO_REFUSED


def test_required_schema_takes_one_or_more_calls_of_given_tools():
    defs = {"unit": {"enum": ["C", "F"]}}
    tools = [*TOOLS, {"type": "function", "function": {"name": "convert", "parameters": {
        "type": "object", "properties": {"to": {"$ref": "#/$defs/unit"}}, "$defs": defs}}}]
    schema = ToolUse(read_tool_use(tools, "required", None).tools, "required").schema()
    assert schema["$defs"] == defs and schema["minItems"] == 1
    good = [{"name": "weather", "parameters": {"city": "Oslo"}}, {"name": "now", "parameters": {}},
            {"name": "convert", "parameters": {"to": "C"}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "other", "parameters": {}}], [{"name": "weather", "parameters": {}}],
                [{"name": "convert", "parameters": {"to": "K"}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert tools[2]["function"]["parameters"]["$defs"] == defs  # the request's tools are left as they were


def test_messages_of_named_and_required_outputs():
    named = read_tool_use(TOOLS, {"type": "function", "function": {"name": "weather"}}, None)
    msg, reason = named.message('{"city": "Oslo"}', "stop")
    call = msg["tool_calls"][0]
    assert reason == "stop" and msg["content"] == "" and call["type"] == "function"  # vLLM, OpenAI: named is stop
    assert call["id"].startswith("chatcmpl-tool-") and call["function"] == {"name": "weather",
                                                                             "arguments": '{"city": "Oslo"}'}
    required = read_tool_use(TOOLS, "required", None)
    msg, reason = required.message('[{"name": "weather", "parameters": {"city": "Zürich"}}, '
                                   '{"name": "now", "parameters": {}}]', "stop")
    assert reason == "tool_calls" and msg["content"] == ""
    assert [c["function"] for c in msg["tool_calls"]] == [{"name": "weather", "arguments": '{"city": "Zürich"}'},
                                                           {"name": "now", "arguments": "{}"}]
    assert len({c["id"] for c in msg["tool_calls"]}) == 2
    assert required.message('[{"name": "wea', "length") == ({"role": "assistant", "content": '[{"name": "wea'},
                                                             "length")


@pytest.mark.parametrize("text, content, calls", [
    ("Sunny.", "Sunny.", []),
    ('<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>', None,
     [("weather", {"city": "Oslo"})]),
    ('Let me check.\n<tool_call>{"name": "weather", "arguments": {"city": "Rome"}}</tool_call>\n'
     '<tool_call>{"name": "now", "arguments": {}}', "Let me check.\n", [("weather", {"city": "Rome"}), ("now", {})]),
    ('<tool_call>{"name": "weather", "arguments": {"ci</tool_call>', None, None),  # not JSON: all text
])
def test_hermes_parser(text, content, calls):
    got_content, got = parse_hermes(text)
    if calls is None:
        assert (got_content, got) == (text, [])
        return
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls


def _streamed(use: ToolUse | None, pieces: list[str], reason: str) -> tuple[dict, str | None]:
    """The message a client's accumulator builds from the deltas of these text pieces, and the last reason."""
    stream, content, calls, last = ToolStream(use), "", {}, None
    for k, piece in enumerate(pieces):
        done = k == len(pieces) - 1
        delta, last = stream.delta(piece, done, reason if done else None)
        content += delta.get("content", "")
        for c in delta.get("tool_calls", []):
            slot = calls.setdefault(c["index"], {"id": c.get("id"), "name": c["function"].get("name"), "args": ""})
            slot["args"] += c["function"].get("arguments") or ""
    return {"content": content, "calls": [(c["name"], c["args"]) for c in calls.values()]}, last


@pytest.mark.parametrize("choice, text, reason", [
    ("auto", 'Checking <tool_call>{"name": "now", "arguments": {}}</tool_call><tool_call>{"name": "weather", '
             '"arguments": {"city": "Oslo"}}</tool_call>', "stop"),
    ("auto", 'Hi\n<tool_call>\n{"name":"weather","arguments":{ "city" :"Os\\u00e9lo\\n" , "n": 1.50, "l": [1,'
             ' 2e1, null, {"k": true}] }}\n</tool_call>', "stop"),  # written as json.dumps writes the arguments
    ("auto", '<tool_call>{"arguments": {"city": "Oslo"}, "name": "weather"}</tool_call>', "stop"),  # name last
    ("auto", 'Not <tool_call>{"name": "now"', "length"),  # cut short after the name: the call as far as it came
    ("required", '[{"name": "now", "parameters": {}}]', "stop"),
    ("required", '[{"name": "weather", "parameters": {"city": "O\\"s}]lo"}}, {"name": "now", "parameters": {}}]',
     "stop"),
    ("required", '[ {"parameters": {"city":"<tool_call>"},"name": "weather"} ]', "stop"),
    ("required", '[{"name": "no', "length"),  # cut short: text
    ("named", '{"city": "Oslo"}', "stop"),
    ("none", "Just text <b>", "stop"),
])
def test_streamed_deltas_add_up_to_the_message(choice, text, reason):
    use = ToolUse(read_tool_use(TOOLS, "none", None).tools, choice, "weather" if choice == "named" else None)
    msg, want = choice_message(use, text, reason)
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls", [])]
    for size in (1, 3, 1000):
        got, last = _streamed(use, [text[k:k + size] for k in range(0, len(text), size)], reason)
        assert last == want
        assert got["content"] == (msg["content"] or "")
        assert got["calls"] == calls


@pytest.mark.parametrize("choice, text, reason, content, calls, want", [
    ("auto", 'Sure.<tool_call>{"name": "f", "arguments": {"a": [1', "length", "Sure.", [("f", '{"a": [')],
     "length"),  # a number is sent once it ends
    ("auto", '<tool_call>{"name": "now", "arguments": {}}</tool_call><tool_call>{"name": "f", "arg', "length", "",
     [("now", "{}"), ("f", "")], "length"),  # the first call whole, the second cut short
    ("required", '[{"name": "weather", "parameters": {"city": "Pa', "length", "", [("weather", '{"city": "Pa')],
     "length"),  # max_tokens cut the call short
    ("auto", 'Sure.<tool_call>\n{"na', "length", 'Sure.<tool_call>\n{"na', [], "length"),  # no call began: text
])
def test_a_call_cut_short_is_in_the_message_as_streamed(choice, text, reason, content, calls, want):
    """A call is streamed once its name is known, and a stream cannot take it back: cut short (length), the message
    holds the calls the stream began, their arguments as far as they came, and no more content than was streamed."""
    use = ToolUse(read_tool_use(TOOLS, "none", None).tools, choice)
    msg, got_reason = choice_message(use, text, reason)
    assert ((msg["content"] or ""), [(c["function"]["name"], c["function"]["arguments"])
                                      for c in msg.get("tool_calls", [])], got_reason) == (content, calls, want)
    for size in (1, 3, 1000):
        got, last = _streamed(use, [text[k:k + size] for k in range(0, len(text), size)], reason)
        assert (got["content"], got["calls"], last) == (content, calls, want)


@pytest.mark.parametrize("text", [
    'Sure.<tool_call>\n{"name": "f"',  # unclosed
    'Sure.<tool_call>{"name": "f", "arguments": {"a": [1',  # EOS mid-arguments
    'Sure.<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>',  # closed, not JSON
])
def test_an_unclosed_or_invalid_call_on_stop_is_content_in_the_message(text):
    """On EOS ("stop") with no valid call in the text, the non-streamed message is the text as content, as vLLM's
    parser gives it: a client running tools on "tool_calls" would get arguments that are no JSON. The stream still
    ends the call it began (it cannot take it back), so there the two differ."""
    use = ToolUse(read_tool_use(TOOLS, "none", None).tools, "auto")
    assert choice_message(use, text, "stop") == ({"role": "assistant", "content": text}, "stop")
    got, last = _streamed(use, [text], "stop")
    assert (got["content"], [name for name, _ in got["calls"]], last) == ("Sure.", ["f"], "tool_calls")


def test_required_stream_sends_the_arguments_as_they_come():
    stream = ToolStream(read_tool_use(TOOLS, "required", None))
    assert stream.delta('[{"name": "no', False, None)[0] == {}
    (head,) = stream.delta('w"', False, None)[0]["tool_calls"]  # the name is known: the call's first delta
    assert head["id"].startswith("chatcmpl-tool-") and (head["index"], head["type"], head["function"]) == (
        0, "function", {"name": "now", "arguments": ""})
    assert stream.delta(', "parameters": {"a": "}', False, None)[0] == {
        "tool_calls": [{"index": 0, "function": {"arguments": '{"a": "}'}}]}
    assert stream.delta('x', False, None)[0] == {"tool_calls": [{"index": 0, "function": {"arguments": "x"}}]}
    first, second = stream.delta('"}}, {"name": "now"', False, None)[0]["tool_calls"]
    assert first == {"index": 0, "function": {"arguments": '"}'}} and second["function"] == {
        "name": "now", "arguments": ""} and second["index"] == 1
    last, reason = stream.delta(', "parameters": {}}]', True, "stop")
    assert reason == "tool_calls" and last == {"tool_calls": [{"index": 1, "function": {"arguments": "{}"}}]}


def test_auto_stream_sends_each_call_as_it_comes():
    stream = ToolStream(ToolUse([], "auto"))
    delta = stream.delta('Hi<tool_call>{"name": "now", "arguments": {', False, None)[0]
    assert delta["content"] == "Hi" and [(c["index"], c["function"]) for c in delta["tool_calls"]] == [
        (0, {"name": "now", "arguments": "{"})]
    assert stream.delta('}}</tool', False, None)[0] == {"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}
    last, reason = stream.delta('_call>\n<tool_call>{"name": "now", "arguments": {"a": 1}}</tool_call>', True,
                                "stop")
    assert reason == "tool_calls" and [(c["index"], c["function"]) for c in last["tool_calls"]] == [
        (1, {"name": "now", "arguments": '{"a": 1}'})]


def test_auto_stream_holds_a_possible_tool_call_start():
    use = ToolUse([], "auto")
    stream = ToolStream(use)
    assert stream.delta("Hi <tool", False, None)[0] == {"content": "Hi "}
    assert stream.delta("s are fun", False, None)[0] == {"content": "<tools are fun"}
    assert stream.delta(" <", True, "length") == ({"content": " <"}, "length")


def test_history_tool_calls_reach_the_template_as_vllm_passes_them():
    call = ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]})
    assert call.as_template_dict() == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}]}
    answer = ChatMessage.model_validate({"role": "tool", "content": "12 C", "tool_call_id": "c1"})
    assert answer.as_template_dict() == {"role": "tool", "content": "12 C", "tool_call_id": "c1"}
    bad = ChatMessage.model_validate({"role": "assistant", "tool_calls": [
        {"id": "c2", "type": "function", "function": {"name": "weather", "arguments": "{city"}}]})
    with pytest.raises(RequestError, match="^messages: "):
        bad.as_template_dict()


def test_auto_tool_choice_option_needs_a_known_parser():
    assert ServerOptions(enable_auto_tool_choice=True, tool_call_parser="hermes").tool_call_parser == "hermes"
    for kw in ({"enable_auto_tool_choice": True}, {"tool_call_parser": "mistral"}):
        with pytest.raises(TokenhaulError, match="tool-call-parser"):
            ServerOptions(**kw)


def test_serve_takes_vllms_tool_options():
    from tokenhaul.cli import build_parser

    args = build_parser().parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    assert (args.enable_auto_tool_choice, args.tool_call_parser) == (True, "hermes")
