"""Structured output through the official openai client against the live server: the embedded
story model knows no JSON, yet every bounded schema gives output that parses and validates,
streamed and not; regexes fullmatch; an EBNF grammar holds; bad constraints are 400s naming
the field."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

MODEL = "stories260K"
NAME = {"type": "string", "maxLength": 10}
AGE = {"type": "integer", "minimum": 0, "maximum": 120}
SCHEMAS = {
    "flat": {"type": "object", "properties": {"name": NAME, "age": AGE}, "required": ["name", "age"]},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    "boolean": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    "const": {"type": "object", "properties": {"kind": {"const": "story"}, "n": AGE}, "required": ["kind", "n"]},
    "int_range": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5}},
                  "required": ["x"]},
    "short_string": {"type": "object", "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 4}},
                     "required": ["s"]},
    "array_bounded": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3}}, "required": ["tags"]},
    "array_of_ints": {"type": "object", "properties": {
        "xs": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4}},
        "required": ["xs"]},
    "nested": {"type": "object", "properties": {
        "owner": {"type": "object", "properties": {"name": NAME, "age": AGE}, "required": ["name", "age"]}},
        "required": ["owner"]},
    "deeply_nested": {"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "object", "properties": {"c": {"type": "boolean"}}, "required": ["c"]}}, "required": ["b"]}},
        "required": ["a"]},
    "optional_fields": {"type": "object", "properties": {"name": NAME, "nick": NAME, "age": AGE}, "required": ["name"]},
    "array_of_objects": {"type": "object", "properties": {"pets": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "age": AGE}, "required": ["kind", "age"]}}},
        "required": ["pets"]},
    "refs": {"$defs": {"point": {"type": "object", "properties": {"x": AGE, "y": AGE}, "required": ["x", "y"]}},
             "type": "object", "properties": {"from": {"$ref": "#/$defs/point"}, "to": {"$ref": "#/$defs/point"}},
             "required": ["from", "to"]},
    "any_of": {"type": "object", "properties": {"v": {"anyOf": [AGE, {"type": "boolean"}, {"enum": ["none"]}]}},
               "required": ["v"]},
    "nullable": {"type": "object", "properties": {"name": {"anyOf": [NAME, {"type": "null"}]}}, "required": ["name"]},
    "top_level_array": {"type": "array", "items": AGE, "minItems": 1, "maxItems": 3},
    "top_level_enum": {"enum": ["yes", "no", "maybe"]},
    "many_fields": {"type": "object", "properties": {k: AGE for k in "abcdef"}, "required": list("abcdef")},
    "mixed_types": {"type": "object", "properties": {"name": NAME, "ok": {"type": "boolean"},
                    "tags": {"type": "array", "items": NAME, "maxItems": 2}, "n": AGE}, "required": ["name", "ok", "tags", "n"]},
    "no_extra_properties": {"type": "object", "properties": {"id": AGE}, "required": ["id"],
                            "additionalProperties": False},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "[A-Z]{2}[0-9]{2}"}},
                "required": ["code"]},
    "defs_with_enum_and_array": {"$defs": {"mood": {"enum": ["happy", "sad"]}}, "type": "object", "properties": {
        "moods": {"type": "array", "items": {"$ref": "#/$defs/mood"}, "minItems": 1, "maxItems": 2}},
        "required": ["moods"]},
}


def _json_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_schema_output_validates(client, name):
    schema = SCHEMAS[name]
    assert len(SCHEMAS) >= 20
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Once upon a time"}], max_tokens=300, temperature=0.0,
        response_format=_json_format(name, schema),
    )
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_schema_output_validates_streamed_and_sampled(client, name):
    schema = SCHEMAS[name]
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Lily and Tom"}], max_tokens=300, temperature=0.9,
        seed=5, n=2, stream=True, response_format=_json_format(name, schema),
    )
    texts, finish = ["", ""], [None, None]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finish[c.index] = c.finish_reason or finish[c.index]
    assert finish == ["stop", "stop"]
    for text in texts:
        jsonschema.validate(json.loads(text), schema)


def test_json_object(client):
    """Any JSON object: a story model fills an unbounded object with story text until the token
    limit, so a logit bias towards "}" (byte token 128) lets it close one; the grammar decides
    where "}" may go, and the result is an object."""
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "The dog"}], max_tokens=200, temperature=0.0,
        response_format={"type": "json_object"}, logit_bias={"128": 30},
    )
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    free = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "The dog"}], max_tokens=30, temperature=0.0,
        response_format={"type": "json_object"},
    )
    assert free.choices[0].message.content.lstrip().startswith("{")


@pytest.mark.parametrize("regex", [r"(yes|no)", r"[A-Z][a-z]{2,8} is [0-9]{1,2} years old\.", r"\d{3}-\d{4}",
                                   r"(red|green|blue)( and (red|green|blue))?"])
@pytest.mark.parametrize("stream", [False, True])
def test_regex_output_fullmatches(client, regex, stream):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=60, temperature=0.0, extra_body={"regex": regex})
    if stream:
        text = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)
    else:
        text = client.completions.create(**kwargs).choices[0].text
    assert re.fullmatch(regex, text), text


def test_ebnf_grammar(client):
    ebnf = 'root ::= sentence ("," " " sentence)?\nsentence ::= ("the" | "a") " " ("cat" | "dog") " " ("ran" | "sat")'
    text = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=40, temperature=0.0, extra_body={"ebnf": ebnf}
    ).choices[0].text
    assert re.fullmatch(r"(the|a) (cat|dog) (ran|sat)(, (the|a) (cat|dog) (ran|sat))?", text), text


def test_native_generate_takes_a_json_schema(server):
    import httpx

    schema = SCHEMAS["flat"]
    r = httpx.post(server.base_url + "/generate", json={
        "text": "Once upon a time", "sampling_params": {"max_new_tokens": 200, "temperature": 0.0,
                                                        "json_schema": json.dumps(schema)}}, timeout=60)
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["text"]), schema)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": _json_format("x", {"type": "objec"})}, "response_format.json_schema.schema"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"extra_body": {"regex": "(ab"}}, "regex"),
        ({"extra_body": {"ebnf": 'root ::= "a" |'}}, "ebnf"),
        ({"response_format": {"type": "json_object"}, "extra_body": {"regex": "a+"}}, "regex"),
    ],
)
def test_bad_constraints_are_400s_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, **extra)
    assert err.value.body["param"] == param, err.value.body


def test_native_bad_constraint_names_the_field(server):
    import httpx

    r = httpx.post(server.base_url + "/generate", json={"text": "a", "sampling_params": {"regex": "[z-a]"}}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.regex", r.text
    r = httpx.post(server.base_url + "/generate", json={"text": "a", "sampling_params": {"regex": "a", "ebnf": "b"}},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("sampling_params."), r.text
