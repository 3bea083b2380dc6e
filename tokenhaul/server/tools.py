"""Tool calling on /v1/chat/completions, as vLLM serves it: a request's tools and tool_choice read and checked, the
tools as the chat template gets them, the JSON schema a named or "required" choice constrains the output with, and
the generated text turned back into an assistant message with tool_calls: the whole text for a named function (its
arguments) or "required" (a JSON array of {name, parameters}), Hermes <tool_call> blocks for "auto". A streamed
choice's deltas: tool_stream.py."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from tokenhaul.errors import RequestError

PARSERS = ("hermes",)  # --tool-call-parser names served
AUTO_REFUSED = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
CALL_START = "<tool_call>"
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)  # an unclosed last block counts


def make_tool_call_id() -> str:
    """vLLM's random tool call id."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _call(name: str, arguments: str, call_id: str | None = None) -> dict:
    return {"id": call_id or make_tool_call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}


@dataclass(frozen=True)
class ToolUse:
    """What a chat request's tools ask for. choice: "none", "auto", "required" or "named" (then `name`)."""

    tools: list[dict]  # as vLLM's ChatCompletionToolsParam.model_dump(): {type, function: {name, description, ...}}
    choice: str
    name: str | None = None

    def schema(self) -> dict | None:
        """The JSON schema the output follows: the named function's parameters, or for "required" vLLM's array of
        at least one {name, parameters} of a given tool (their $defs gathered at the top)."""
        if self.choice == "named":
            fn = next(t["function"] for t in self.tools if t["function"]["name"] == self.name)
            return fn["parameters"] or {"type": "object", "properties": {}}
        if self.choice != "required":
            return None
        items, defs = [], {}
        for t in self.tools:
            fn = t["function"]
            params = dict(fn["parameters"] or {"type": "object", "properties": {}})
            for key, value in params.pop("$defs", {}).items():
                if defs.setdefault(key, value) != value:
                    raise RequestError(f"tools: the definition {key!r} has two different schemas")
            items.append({"properties": {"name": {"type": "string", "enum": [fn["name"]]}, "parameters": params},
                          "required": ["name", "parameters"]})
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
        return schema | ({"$defs": defs} if defs else {})

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The assistant message of a choice's whole text, and its finish_reason: vLLM's (and OpenAI's) "tool_calls"
        for "required" and for "auto" when calls were parsed; the engine's for a named function."""
        if self.choice == "named":
            return {"role": "assistant", "content": "", "tool_calls": [_call(self.name or "", text)]}, finish_reason
        if self.choice == "required":
            calls = required_calls(text)
            if calls is None:  # cut short (length): not an array of calls; the text as it came
                return {"role": "assistant", "content": text}, finish_reason
            return ({"role": "assistant", "content": "", "tool_calls": calls},
                    "tool_calls" if calls and finish_reason == "stop" else finish_reason)
        if self.choice == "auto":
            content, calls = parse_hermes(text)
            if calls:
                return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"
        return {"role": "assistant", "content": text}, finish_reason


def read_tool_use(tools: list[Any] | None, tool_choice: str | dict | None, parser: str | None) -> ToolUse | None:
    """A request's tools and tool_choice (None: neither; plain text), checked as vLLM checks them: tool_choice needs
    tools, "auto" (the default with tools) needs the server's tool call parser, a named function must be given."""
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none":
        return None if tools is None else ToolUse(read_tools(tools), "none")
    if tools is None:
        raise RequestError("tool_choice: when using `tool_choice`, `tools` must be set")
    if tool_choice == "required" and not tools:  # OpenAI's: as "none"
        return ToolUse([], "none")
    checked = read_tools(tools)
    if tool_choice in ("auto", "required"):
        if tool_choice == "auto" and parser is None:
            raise RequestError(AUTO_REFUSED)
        return ToolUse(checked, tool_choice)
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
            or tool_choice.get("type", "function") != "function":
        raise RequestError('tool_choice: "none", "auto", "required" or {"type": "function", "function": '
                           f'{{"name": ...}}}}, got {json.dumps(tool_choice)[:200]}')
    if fn["name"] not in {t["function"]["name"] for t in checked}:
        raise RequestError(f"tool_choice: the function {fn['name']!r} is not one of the given tools")
    return ToolUse(checked, "named", fn["name"])


def with_tools(template_kwargs: dict[str, Any] | None, tools: list[dict] | None) -> dict[str, Any] | None:
    """The chat template's variables: the checked tools (if any) under "tools", the request's own kwargs winning
    (vLLM's chat_template_kwargs), as chat completions and /tokenize render a chat."""
    return template_kwargs if tools is None else {"tools": tools} | (template_kwargs or {})


def read_tools(tools: list[Any]) -> list[dict]:
    """Each tool as vLLM's model_dump() gives it to the template; anything else is a 400 naming tools."""
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise RequestError(f'tools: tool {i} must be {{"type": "function", "function": {{"name": ...}}}}')
        name, params, desc = fn.get("name"), fn.get("parameters"), fn.get("description")
        if not isinstance(name, str) or not name:
            raise RequestError(f"tools: tool {i}'s function needs a name (a string)")
        if params is not None and not isinstance(params, dict):
            raise RequestError(f"tools: tool {i} ({name}): parameters must be a JSON schema object")
        if desc is not None and not isinstance(desc, str):
            raise RequestError(f"tools: tool {i} ({name}): description must be a string")
        out.append({"type": "function", "function": {**fn, "name": name, "description": desc, "parameters": params}})
    return out


def required_calls(text: str) -> list[dict] | None:
    """The calls of a "required" output (a JSON array of {name, parameters}), arguments as JSON text; None if the
    text is no such array (the output was cut short)."""
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list) or not all(isinstance(c, dict) and isinstance(c.get("name"), str)
                                              for c in items):
        return None
    return [_call(c["name"], json.dumps(c.get("parameters") or {}, ensure_ascii=False)) for c in items]


def parse_hermes(text: str) -> tuple[str | None, list[dict]]:
    """vLLM's hermes parser: (content, calls) of a text holding <tool_call>{"name": ..., "arguments": ...}</tool_call>
    blocks: content is the text before the first block (None if empty); a block that is not such JSON makes the
    whole text content, with no calls."""
    if CALL_START not in text:
        return text, []
    calls = []
    for closed, unclosed in _HERMES.findall(text):
        try:
            obj = json.loads(closed or unclosed)
        except ValueError:
            return text, []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, []
        calls.append(_call(obj["name"], json.dumps(obj.get("arguments", {}), ensure_ascii=False)))
    content = text[:text.find(CALL_START)]
    return content or None, calls
