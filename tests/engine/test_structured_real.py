"""Structured outputs on SmolLM2-135M: a JSON schema's output parses and validates, greedy and sampled."""

import json

import jsonschema
import pytest

from tokenhaul.sampling_params import SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.real_model

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "maximum": 120}}}
CHAT = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]


@pytest.mark.parametrize("kw", [dict(temperature=0), dict(temperature=0.8, seed=5)])
def test_json_schema_output_validates(smollm, kw):
    so = StructuredOutputsParams(json=SCHEMA)
    out = smollm.chat([CHAT, CHAT], SamplingParams(max_tokens=40, structured_outputs=so, **kw))
    for o in out:
        c = o.outputs[0]
        value = json.loads(c.text)
        jsonschema.validate(value, SCHEMA)
        assert c.finish_reason == "stop" and isinstance(value["age"], int)


def test_json_object_and_choice(smollm):
    out = smollm.chat([CHAT], SamplingParams(max_tokens=40, temperature=0,
                                             structured_outputs=StructuredOutputsParams(json_object=True)))
    assert isinstance(json.loads(out[0].outputs[0].text), dict)
    out = smollm.chat([CHAT], SamplingParams(max_tokens=10, temperature=0,
                                             structured_outputs=StructuredOutputsParams(choice=["alpha", "beta"])))
    assert out[0].outputs[0].text in ("alpha", "beta") and out[0].outputs[0].finish_reason == "stop"
