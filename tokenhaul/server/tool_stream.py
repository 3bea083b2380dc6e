"""A streamed chat choice's deltas with tools, as vLLM streams them: plain text (no tools, "none") as content; a
named function's arguments as they come; each call of "required" (a JSON array of {name, parameters}) and of
"auto" (Hermes <tool_call>{"name": ..., "arguments": ...}</tool_call> blocks) as a first delta with the call's
index, id, type and name once its name is known, then its arguments' JSON text piece by piece as it is generated,
written as the non-streamed message writes them (json_stream.py), so the pieces add up to its arguments. The
non-streamed message is the one the stream adds up to (choice_message), but for one case: on EOS ("stop") with no
valid call in the text (a block unclosed or not JSON), the stream has ended the calls it began (it cannot take them
back) while the message is the text as content, "stop", as vLLM's parser gives it, so that no client runs a call
whose arguments are no JSON; cut short ("length"), both hold the calls as far as they came (OpenAI's too)."""

from __future__ import annotations

import json

from tokenhaul.server.json_stream import JSONValueStream
from tokenhaul.server.tools import CALL_START, ToolUse, make_tool_call_id


def choice_message(use: ToolUse, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
    """The non-streamed message of a choice's whole text, and its finish_reason: what its stream adds up to, but on
    "stop" with no valid call the text's own message (content), not calls whose arguments are no JSON."""
    message, reason = use.message(text, finish_reason)
    if use.choice not in ("auto", "required") or (finish_reason == "stop" and "tool_calls" not in message):
        return message, reason
    stream = ToolStream(use)
    stream.delta(text, True, finish_reason)
    return stream.message, stream.reason


class ToolStream:
    """One streamed choice. "auto" streams content until a <tool_call> may begin, then no more content: its calls
    as they are generated, and at the end what the whole text's message holds beyond them (or, if no call began,
    the rest as text, as the non-streamed message)."""

    def __init__(self, use: ToolUse | None) -> None:
        self.use = use
        self.text = ""
        self.read = 0  # characters of text read for calls
        self.sent = 0  # characters of text sent as content
        self.held = False  # "auto": a <tool_call> began; no more content until the end
        self.call_id: str | None = None  # named: the call's id, once its first delta is sent
        self.call: _CallReader | None = None  # the call being read
        self.array = "before"  # "required": where the array of calls is read: before, in, after
        self.calls: list[dict] = []  # per call started: its id and name, and the arguments sent
        self.message: dict = {}  # at the end: the choice's message, the deltas' sum
        self.reason: str | None = None

    def delta(self, text: str, finished: bool, finish_reason: str | None) -> tuple[dict, str | None]:
        """The delta of new text, and at the end the choice's finish_reason (the whole message's)."""
        self.text += text
        if self.use is None or self.use.choice == "none":
            return ({"content": text} if text else {}), finish_reason
        if self.use.choice == "named":
            return self._named(text), finish_reason
        out = self._auto_content() if self.use.choice == "auto" else ""
        calls = self._read_calls()
        if finished:
            self.message, self.reason = self.use.message(self.text, finish_reason)
            if "tool_calls" not in self.message and self.calls:
                # the text holds no valid calls (cut short, or a block unclosed or not JSON), but calls were
                # streamed once their names were known, and a stream cannot take them back (nor does vLLM's): the
                # stream ends them as far as they came (OpenAI's too under "length"); choice_message does so only
                # under "length"
                content = self.text[:self.sent] or (None if self.use.choice == "auto" else "")  # as use.message
                self.message = {"role": "assistant", "content": content, "tool_calls": [
                    {k: c[k] for k in ("id", "type", "function")} for c in self.calls]}
                self.reason = "tool_calls" if finish_reason == "stop" else finish_reason
            calls += self._rest_of_calls(self.message.get("tool_calls") or [])
            if "tool_calls" not in self.message:  # no call began ("auto"), or "required" cut short: the rest is text
                out += self.text[self.sent:]
                self.sent = len(self.text)
        return ({"content": out} if out else {}) | ({"tool_calls": _merged(calls)} if calls else {}), self.reason

    def _named(self, text: str) -> dict:
        if not text:
            return {}
        if self.call_id is None:
            self.call_id = make_tool_call_id()
            return {"tool_calls": [_header(0, self.call_id, self.use.name or "", text)]}
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

    def _read_calls(self) -> list[dict]:
        """The call deltas of the text read since the last look: headers, argument pieces."""
        out: list[dict] = []
        while self.read < len(self.text) and self.array != "after":
            if self.call is None and not self._next_call():
                break
            call = self.call
            for ch in self.text[self.read:]:
                used = call.feed(ch)
                self.read += used
                if call.done:
                    break
            out += self._call_deltas(call)
            if not call.done:
                break
            self.call = None
        return out

    def _next_call(self) -> bool:
        """Move to where the next call's object begins: after a <tool_call> ("auto"), or at an element of the array
        ("required"); False if it is not in the text yet."""
        if self.use.choice == "auto":
            start = self.text.find(CALL_START, self.read)
            if start < 0:
                self.read = max(self.read, len(self.text) - len(CALL_START) + 1)
                return False
            self.read = start + len(CALL_START)
            self.call = _CallReader("arguments")
            return True
        for k in range(self.read, len(self.text)):
            ch = self.text[k]
            if ch == "[" and self.array == "before":
                self.array = "in"
            elif ch == "{" and self.array == "in":
                self.read = k
                self.call = _CallReader("parameters")
                return True
            elif ch == "]" and self.array == "in":
                self.array = "after"
                return False
        self.read = len(self.text)
        return False

    def _call_deltas(self, call: _CallReader) -> list[dict]:
        """The current call's header once its name is known, and the argument text read since."""
        if call.name is None:
            return []
        pieces = call.take_arguments()
        if call.index is None:
            call.index = len(self.calls)
            call_id = make_tool_call_id()
            self.calls.append(_header(call.index, call_id, call.name, pieces))  # a copy: _merged adds to the one sent
            return [_header(call.index, call_id, call.name, pieces)]
        self.calls[call.index]["function"]["arguments"] += pieces
        return [{"index": call.index, "function": {"arguments": pieces}}] if pieces else []

    def _rest_of_calls(self, calls: list[dict]) -> list[dict]:
        """At the end: what the message's calls hold beyond what was streamed — the rest of a call's arguments (none
        where they add up already), and any call not begun whole."""
        out = []
        for k, c in enumerate(calls):
            args = c["function"]["arguments"]
            if k >= len(self.calls):
                out.append({"index": k, **c})
                continue
            sent = self.calls[k]["function"]["arguments"]
            if args.startswith(sent) and len(args) > len(sent):
                out.append({"index": k, "function": {"arguments": args[len(sent):]}})
        return out


class _CallReader:
    """One call's JSON object ({"name": ..., <arguments key>: ...}) read character by character: its name once the
    name's string closes, its arguments as canonical JSON text (held until the name is known)."""

    def __init__(self, arguments_key: str) -> None:
        self.arguments_key = arguments_key
        self.name: str | None = None
        self.index: int | None = None  # the call's index in the choice, once its header is sent
        self.done = False
        self.opened = False
        self.key: JSONValueStream | None = None  # the key being read, and its raw text
        self.key_text = ""
        self.field = ""  # the key whose value is read
        self.value: JSONValueStream | None = None
        self.value_text = ""
        self.pending = ""  # canonical arguments text not taken yet

    def feed(self, ch: str) -> int:
        """Read one character; 1 if it is the object's, 0 if it is the one after the object ends."""
        if self.done:
            return 0
        if self.value is not None:
            piece, used = self.value.feed(ch)
            if self.field == self.arguments_key:
                self.pending += piece
            elif used:
                self.value_text += ch
            if self.value.done:
                if self.field == "name" and self.name is None:
                    self.name = _string(self.value_text)
                self.value = None
            if used:
                return 1
        if self.key is not None:
            self.key_text += ch
            self.key.feed(ch)
            if self.key.done:
                self.field, self.key = _string(self.key_text) or "", None
            return 1
        if not self.opened:
            self.opened = ch == "{"
        elif ch == '"':
            self.key, self.key_text = JSONValueStream(), ch
            self.key.feed(ch)
        elif ch == ":":
            self.value, self.value_text = JSONValueStream(), ""
        elif ch == "}":
            self.done = True
        return 1

    def take_arguments(self) -> str:
        out, self.pending = self.pending, ""
        return out


def _string(text: str) -> str | None:
    """A JSON string's value (None: the text is no JSON string)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def _header(index: int, call_id: str, name: str, arguments: str) -> dict:
    """A streamed call's first delta (vLLM's): its index in the choice, id, type and name, with the arguments so far."""
    return {"index": index, "id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _merged(calls: list[dict]) -> list[dict]:
    """One entry per call in a delta: a call's later argument pieces joined to its entry."""
    out: list[dict] = []
    for c in calls:
        if out and out[-1]["index"] == c["index"] and set(c) == {"index", "function"}:
            out[-1]["function"]["arguments"] += c["function"]["arguments"]
        else:
            out.append(c)
    return out


def _partial_start(text: str) -> int:
    """How many characters at the end of text may begin a <tool_call> (held back until the next text)."""
    return next((k for k in range(min(len(text), len(CALL_START) - 1), 0, -1) if CALL_START.startswith(text[-k:])), 0)
