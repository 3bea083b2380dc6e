"""A JSON value's text read as it is generated, rewritten piece by piece as json.dumps(json.loads(text),
ensure_ascii=False) writes the whole value: no whitespace outside strings, ", " and ": " between items, strings
with json.dumps' escapes, numbers and literals as Python writes them. The pieces add up to what a parser of the
finished text gives (a duplicate key, which json.loads collapses, is the exception), so a streamed tool call's
arguments add up to the non-streamed ones."""

from __future__ import annotations

import json

_WHITESPACE = " \t\n\r"
_BARE_END = set(_WHITESPACE + ',:[]{}"')  # what ends a number or literal
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


class JSONValueStream:
    """One JSON value, character by character: feed() gives its canonical text so far; `done` once it is whole."""

    def __init__(self) -> None:
        self.done = False
        self.depth = 0  # objects and arrays open
        self._in_string = False
        self._escape: str | None = None  # after a backslash: the escape's characters so far
        self._high = ""  # a \\ud800-\\udbff escape waiting for its low half (json.loads joins the pair)
        self._bare = ""  # a number or literal read so far

    def feed(self, ch: str) -> tuple[str, bool]:
        """(the canonical text ch adds, whether ch is part of the value): a number or literal ends only at the
        character after it, which is not the value's when the value is that number or literal."""
        if self._in_string:
            return self._string_char(ch), True
        if self._bare:
            if ch not in _BARE_END:
                self._bare += ch
                return "", True
            token, self._bare = self._bare, ""
            out = _dump_token(token)
            if self.depth == 0:
                self.done = True
                return out, False
            more, _ = self.feed(ch)
            return out + more, True
        if ch in _WHITESPACE:
            return "", True
        if ch == '"':
            self._in_string = True
            return '"', True
        if ch in "[{":
            self.depth += 1
            return ch, True
        if ch in "]}":
            self.depth -= 1
            self.done = self.depth == 0
            return ch, True
        if ch in ",:":
            return ch + " ", True
        self._bare = ch
        return "", True

    def _string_char(self, ch: str) -> str:
        if self._escape is not None:
            self._escape += ch
            if self._escape[0] == "u" and len(self._escape) < 5:
                return ""
            esc, self._escape = self._escape, None
            if esc[0] == "u":
                try:
                    return self._text(chr(int(esc[1:], 16)))
                except ValueError:  # not JSON: no parser takes the call
                    return ""
            return self._text(_ESCAPES.get(esc, esc))
        if ch == "\\":
            self._escape = ""
            return ""
        if ch == '"':
            self._in_string = False
            self.done = self.depth == 0
            high, self._high = self._high, ""
            return _dump_char(high) + '"' if high else '"'
        return self._text(ch)

    def _text(self, c: str) -> str:
        """A character of the string's value as json.dumps writes it."""
        if self._high:
            high, self._high = self._high, ""
            if "\udc00" <= c <= "\udfff":
                return chr(0x10000 + ((ord(high) - 0xD800) << 10) + (ord(c) - 0xDC00))
            return _dump_char(high) + self._text(c)
        if "\ud800" <= c <= "\udbff":
            self._high = c
            return ""
        return _dump_char(c)


def _dump_char(c: str) -> str:
    return c if c >= " " and c not in '"\\' else json.dumps(c)[1:-1]


def _dump_token(token: str) -> str:
    """A number or literal as json.dumps writes what json.loads reads (1.50 → 1.5, 1e2 → 100.0)."""
    try:
        return json.dumps(json.loads(token))
    except ValueError:  # not JSON: no parser takes the call
        return token
