"""Structured outputs over HTTP with the official openai client on SmolLM2-135M: response_format json_schema and
json_object, vLLM's structured_outputs and guided_* extras, chat and completions, streamed as non-streamed."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from serverkit import MODEL

pytestmark = pytest.mark.real_model

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "population"],
          "properties": {"city": {"type": "string", "maxLength": 16},
                         "population": {"type": "integer", "maximum": 10**9}}}
ASK = [{"role": "user", "content": "Give a city and its population as JSON."}]


@pytest.fixture(scope="module")
def oai(real_server):
    with openai.OpenAI(base_url=real_server[0] + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def test_chat_json_schema_validates_and_streams_the_same(oai):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    kw = dict(model=MODEL, messages=ASK, max_tokens=40, temperature=0, response_format=fmt)
    r = oai.chat.completions.create(**kw)
    text = r.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    assert r.choices[0].finish_reason == "stop"
    chunks = list(oai.chat.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text


def test_chat_json_object_and_seeded_samples(oai):
    person = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]
    r = oai.chat.completions.create(model=MODEL, messages=person, max_tokens=40, temperature=0,
                                    response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict) and r.choices[0].finish_reason == "stop"
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
    r = oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, temperature=0.8, seed=3, n=2,
                                    response_format=fmt)
    assert len(r.choices) == 2
    for c in r.choices:
        jsonschema.validate(json.loads(c.message.content), SCHEMA)


def test_vllm_extras_on_chat_and_completions(oai):
    r = oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=10, temperature=0,
                                    extra_body={"guided_choice": ["Paris", "Rome", "Oslo"]})
    assert r.choices[0].message.content in ("Paris", "Rome", "Oslo")
    r = oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=10, temperature=0,
                                    extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].message.content in ("yes", "no")
    r = oai.completions.create(model=MODEL, prompt="The year is", max_tokens=10, temperature=0,
                               extra_body={"guided_regex": r" [0-9]{4}"})
    assert re.fullmatch(r" [0-9]{4}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    r = oai.completions.create(model=MODEL, prompt="A person:", max_tokens=40, temperature=0,
                               extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)


def test_a_bad_schema_is_a_400_naming_the_field(oai):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
        "a": {"type": "nope"}}}}}
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, response_format=bad)
    assert e.value.body["param"] == "response_format" and "nope" in e.value.body["message"]
