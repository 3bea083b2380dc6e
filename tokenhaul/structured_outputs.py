"""StructuredOutputsParams: the one constraint a request's output must follow (vLLM's names: json, regex, choice,
grammar, json_object), turned into an llguidance grammar and validated once, with a one-line error."""

from __future__ import annotations

import json
from dataclasses import dataclass

from llguidance import LLMatcher
from llguidance.gbnf_to_lark import any_to_lark

from tokenhaul.errors import RequestError

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    json: str | dict | None = None  # a JSON schema (text or parsed)
    regex: str | None = None
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # Lark (llguidance's dialect) or GBNF (llama.cpp's)
    json_object: bool | None = None  # any JSON object
    disable_any_whitespace: bool = False  # JSON without free whitespace between tokens (vLLM's)

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise RequestError("structured_outputs takes exactly one of json, regex, choice, grammar, json_object; "
                               f"got {', '.join(given) or 'none'}")
        self.kind = given[0]
        self.spec = self._grammar()
        error = LLMatcher.validate_grammar(self.spec)
        if error:
            raise RequestError(f"structured_outputs.{self.kind} is invalid: {_one_line(error)}")

    def _grammar(self) -> str:
        """The llguidance grammar (a JSON string) for the constraint; raises RequestError on malformed input."""
        if self.kind in ("json", "json_object"):
            schema = {"type": "object"} if self.kind == "json_object" else self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise RequestError(f"structured_outputs.json is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise RequestError(f"structured_outputs.json must be a JSON schema object, got "
                                   f"{type(schema).__name__}")
            return LLMatcher.grammar_from_json_schema(
                schema, defaults={"whitespace_flexible": not self.disable_any_whitespace})
        if self.kind == "regex":
            _check_str(self.regex, "regex")
            return LLMatcher.grammar_from_regex(self.regex)
        if self.kind == "choice":
            if not isinstance(self.choice, (list, tuple)) or not self.choice or not all(
                    isinstance(c, str) and c for c in self.choice):
                raise RequestError(f"structured_outputs.choice must be a non-empty list of non-empty strings, "
                                   f"got {self.choice!r}")
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))
        _check_str(self.grammar, "grammar")
        try:
            lark = any_to_lark(self.grammar)  # GBNF → Lark; Lark passes through
        except Exception as e:  # noqa: BLE001 - the converter raises plain exceptions on bad input
            raise RequestError(f"structured_outputs.grammar is invalid: {_one_line(str(e))}") from None
        return LLMatcher.grammar_from_lark(lark)


def _check_str(value: object, name: str) -> None:
    if not isinstance(value, str) or not value:
        raise RequestError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")


def _one_line(msg: str) -> str:
    return " ".join(msg.split())[:300]
