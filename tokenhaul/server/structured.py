"""The structured output a chat or completions request asks for, read from OpenAI's response_format, vLLM's
structured_outputs, vLLM's older guided_* fields or a chat's tools (the schema of a named or "required"
tool_choice; one of them), as the engine's StructuredOutputsParams. A
malformed one is a RequestError whose first word is the field it came in (the 400's param)."""

from __future__ import annotations

from typing import Any

from tokenhaul.errors import RequestError
from tokenhaul.sampling_params import SamplingParams, StructuredOutputsParams

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
SOURCES = ("response_format", "structured_outputs", *GUIDED)


def structured_outputs(fields: dict[str, Any]) -> StructuredOutputsParams | None:
    """fields: the request's values of SOURCES → the one constraint they set (None: plain text)."""
    given = [(name, _as_fields(name, value)) for name, value in fields.items() if value is not None]
    given = [(name, f) for name, f in given if f is not None]
    if not given:
        return None
    if len(given) > 1:
        raise RequestError(f"{given[1][0]}: give one structured output constraint, not both "
                           f"{given[0][0]} and {given[1][0]}")
    name, so = given[0]
    try:
        return SamplingParams(structured_outputs=so).structured_outputs
    except RequestError as e:
        raise RequestError(f"{name}: {str(e).removeprefix('structured_outputs').lstrip('. ')}") from None


def _as_fields(name: str, value: Any) -> dict[str, Any] | None:
    """One source's value as StructuredOutputsParams' fields (None: it asks for nothing, as response_format text)."""
    if name in GUIDED:
        return {GUIDED[name]: value}
    if name == "structured_outputs":
        return value
    if name == "tools":  # the JSON schema a tool_choice constrains the output with (server/tools.py)
        return {"json": value}
    kind = value.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":  # OpenAI's {"json_schema": {"name", "schema", "strict"}}: the schema is enforced
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or spec.get("schema") is None:
            raise RequestError("response_format: json_schema.schema is required with type json_schema")
        return {"json": spec["schema"]}
    raise RequestError(f"response_format: type must be text, json_object or json_schema, got {kind!r}")
