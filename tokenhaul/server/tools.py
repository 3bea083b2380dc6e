"""Tool calling on /v1/chat/completions, as vLLM serves it: a request's tools and tool_choice read and checked, the
tools as the chat template gets them, the JSON schema a named or "required" choice constrains the output with, and
the generated text turned back into an assistant message with tool_calls: the whole text for a named function (its
arguments) or "required" (a JSON array of {name, parameters}), Hermes <tool_call> blocks for "auto"."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from tokenhaul.errors import RequestError

PARSERS = ("hermes",)  # --tool-call-parser names served
AUTO_REFUSED = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
CALL_START, CALL_END = "<tool_call>", "</tool_call>"
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


class ToolStream:
    """One streamed choice's deltas. Plain text (no tools, "none") streams as content. A named function streams its
    arguments as they come, the first delta carrying the call's id and name (vLLM). "required" sends each call whole
    once its element of the JSON array closes (vLLM also streams a call's arguments, from a partial JSON parser).
    "auto" streams content until a <tool_call> may begin, then sends each call as its block closes, and at the end
    what is left (or, if the whole text holds no call, the rest as text, as the non-streamed message)."""

    def __init__(self, use: ToolUse | None) -> None:
        self.use = use
        self.text = ""
        self.sent = 0  # characters of text sent as content
        self.held = False  # "auto": a <tool_call> began; no more content until the end
        self.blocks_read = 0  # "auto": characters of text read for closed blocks
        self.call_id: str | None = None  # named: the call's id, once its first delta is sent
        self.elements = _ArrayElements()  # "required": the array's elements as they close
        self.num_calls = 0  # calls sent

    def delta(self, text: str, finished: bool, finish_reason: str | None) -> tuple[dict, str | None]:
        """The delta of new text, and at the end the choice's finish_reason (the whole message's)."""
        self.text += text
        if self.use is None or self.use.choice == "none":
            return ({"content": text} if text else {}), finish_reason
        if self.use.choice == "named":
            return self._named(text), finish_reason
        out = self._auto_content() if self.use.choice == "auto" else ""
        calls = self._auto_calls() if self.use.choice == "auto" else \
            [c for e in self.elements.closed(self.text) for c in required_calls(f"[{e}]") or []]
        reason = None
        if finished:
            message, reason = self.use.message(self.text, finish_reason)
            calls = (message.get("tool_calls") or [])[self.num_calls:]
            if "tool_calls" not in message:  # no call parsed ("auto"), or "required" cut short: the rest is text
                out += self.text[self.sent:]
                self.sent = len(self.text)
        indexed = [{"index": self.num_calls + k, **c} for k, c in enumerate(calls)]
        self.num_calls += len(calls)
        return ({"content": out} if out else {}) | ({"tool_calls": indexed} if indexed else {}), reason

    def _named(self, text: str) -> dict:
        if not text:
            return {}
        if self.call_id is None:
            self.call_id = make_tool_call_id()
            return {"tool_calls": [{"index": 0, **_call(self.use.name or "", text, self.call_id)}]}
        return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}

    def _auto_content(self) -> str:
        """"auto": the new text that cannot be part of a tool call (none once a <tool_call> began)."""
        if self.held:
            return ""
        start = self.text.find(CALL_START, self.sent)
        self.held = start >= 0
        end = start if self.held else len(self.text) - _partial_start(self.text)
        out, self.sent = self.text[self.sent:end], end
        return out


    def _auto_calls(self) -> list[dict]:
        """"auto": the calls of the blocks that closed since the last look."""
        calls: list[dict] = []
        while self.held:
            start = self.text.find(CALL_START, self.blocks_read)
            end = self.text.find(CALL_END, start) if start >= 0 else -1
            if end < 0:
                break
            self.blocks_read = end + len(CALL_END)
            calls += parse_hermes(self.text[start:self.blocks_read])[1]
        return calls


class _ArrayElements:
    """The elements of a JSON array of objects as their text closes, read character by character."""

    def __init__(self) -> None:
        self.read = 0  # characters of the text read
        self.depth = 0
        self.start = 0  # where the current element began
        self.in_string = self.escaped = False

    def closed(self, text: str) -> list[str]:
        """The elements that close in the text so far since the last call."""
        out = []
        for k in range(self.read, len(text)):
            ch = text[k]
            if self.in_string:
                self.escaped, self.in_string = (False, True) if self.escaped else (ch == "\\", ch != '"')
            elif ch == '"':
                self.in_string = True
            elif ch in "[{":
                self.depth += 1
                self.start = k if self.depth == 2 else self.start
            elif ch in "]}":
                self.depth -= 1
                if self.depth == 1:
                    out.append(text[self.start:k + 1])
        self.read = len(text)
        return out


def _partial_start(text: str) -> int:
    """How many characters at the end of text may begin a <tool_call> (held back until the next text)."""
    return next((k for k in range(min(len(text), len(CALL_START) - 1), 0, -1) if CALL_START.startswith(text[-k:])), 0)
