"""The tool-call formats on recorded model outputs (Hermes/Qwen, Llama 3, Mistral), whole and
streamed in pieces split anywhere, and the forced-call schema and parser."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
from tool_call_checks import assert_deltas_build, call_values, stream_in_pieces

from batonlm.tool_calls.forced import forced_schema, parse_forced
from batonlm.tool_calls.formats import HermesParser, Llama3Parser, MistralParser, parser_for

WEATHER = {"city": "Paris", "unit": "celsius"}

# (parser, model output, expected content, expected [(name, arguments)])
RECORDED = [
    (HermesParser, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
     "", [("get_weather", WEATHER)]),
    (HermesParser, 'Let me check that for you.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
     '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>',
     "Let me check that for you.", [("get_weather", WEATHER), ("get_time", {"tz": "CET"})]),
    (HermesParser, "No tools needed: it is sunny.", "No tools needed: it is sunny.", []),
    (HermesParser, "<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>", []),
    (Llama3Parser, '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', "",
     [("get_weather", WEATHER)]),
    (Llama3Parser, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
     '{"name": "get_time", "parameters": {"tz": "CET"}}', "", [("get_weather", WEATHER), ("get_time", {"tz": "CET"})]),
    (Llama3Parser, "The weather in Paris is {mild}.", "The weather in Paris is {mild}.", []),
    (MistralParser, '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]', "",
     [("get_weather", WEATHER)]),
    (MistralParser, 'Sure.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
     '{"name": "get_time", "arguments": {"tz": "CET"}}]', "Sure.", [("get_weather", WEATHER), ("get_time", {"tz": "CET"})]),
    (MistralParser, '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}',
     "", [("get_weather", WEATHER), ("get_time", {"tz": "CET"})]),
    (MistralParser, "[TOOL_CALLS] oops", "[TOOL_CALLS] oops", []),
]


@pytest.mark.parametrize(("cls", "text", "content", "calls"), RECORDED)
def test_recorded_outputs(cls, text, content, calls):
    parsed = cls().parse(text)
    assert parsed.content == content
    assert call_values(parsed.calls) == calls
    assert all(c.id.startswith("call_") for c in parsed.calls) and len({c.id for c in parsed.calls}) == len(parsed.calls)


@pytest.mark.parametrize(("cls", "text", "content", "calls"), RECORDED)
def test_streamed_in_random_pieces(cls, text, content, calls):
    rng = random.Random(len(text))
    for _ in range(20):
        sent, deltas, rest = stream_in_pieces(cls(), text, rng)
        assert_deltas_build(deltas, rest.calls)
        if calls:
            # Content before the calls streams out (whitespace before a marker may trail).
            assert (sent + rest.content).rstrip() == content
            assert not any(m in sent for m in cls.start_markers)
        else:
            assert sent + rest.content == text
        assert call_values(rest.calls) == calls


def test_parser_choice():
    assert isinstance(parser_for("auto", "Qwen2ForCausalLM"), HermesParser)
    assert isinstance(parser_for("auto", "LlamaForCausalLM"), Llama3Parser)
    assert isinstance(parser_for("auto", "MistralForCausalLM"), MistralParser)
    assert isinstance(parser_for("mistral", "Qwen3ForCausalLM"), MistralParser)


def test_forced_schema_and_parse():
    params = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    one = forced_schema([("add", params)], parallel=False)
    jsonschema.validate({"name": "add", "arguments": {"a": 1}}, one)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "sub", "arguments": {"a": 1}}, one)
    many = forced_schema([("add", params), ("noop", None)], parallel=True)
    jsonschema.validate([{"name": "noop", "arguments": {}}, {"name": "add", "arguments": {"a": 2}}], many)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], many)
    assert call_values(parse_forced('[{"name": "add", "arguments": {"a": 2}}]')) == [("add", {"a": 2})]
    assert call_values(parse_forced('{"name": "add", "arguments": {"a": 2}}')) == [("add", {"a": 2})]
    assert parse_forced('{"name": "add", "arguments": {"a": ') == []


def test_forced_calls_keep_each_tools_local_definitions():
    """Tool parameters with `$defs` (pydantic's nested models): in the combined schema of a forced
    call, "#/$defs/Addr" pointed nowhere and the request failed with a 400 naming json_schema."""
    from batonlm.constrained.grammar import check_constraint

    addr = {"type": "object", "properties": {"city": {"type": "string"}, "next": {"$ref": "#/$defs/Addr"}},
            "required": ["city"]}
    person = {"$defs": {"Addr": addr}, "type": "object", "properties": {"home": {"$ref": "#/$defs/Addr"}},
              "required": ["home"]}
    other = {"definitions": {"Addr": {"type": "integer"}}, "type": "object",
             "properties": {"home": {"$ref": "#/definitions/Addr"}}, "required": ["home"]}
    for parallel in (False, True):
        schema = forced_schema([("person", person), ("other", other)], parallel)
        check_constraint("json_schema", json.dumps(schema))  # the grammar backend resolves every $ref
        wrap = (lambda c: [c]) if parallel else (lambda c: c)
        jsonschema.validate(wrap({"name": "person", "arguments": {"home": {"city": "a", "next": {"city": "b"}}}}),
                            schema)
        jsonschema.validate(wrap({"name": "other", "arguments": {"home": 3}}), schema)  # its own Addr
        for bad in ({"name": "person", "arguments": {"home": {"town": "a"}}},
                    {"name": "other", "arguments": {"home": {"city": "a"}}}):
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(wrap(bad), schema)


def test_a_cut_array_keeps_its_completecall_values():
    from batonlm.tool_calls.forced import complete_items

    whole = '[ {"name": "add", "arguments": {"a": 2, "s": "}]\\""}} ,{"name": "noop", "arguments": {}}]'
    assert complete_items(whole) == [{"name": "add", "arguments": {"a": 2, "s": '}]"'}}, {"name": "noop", "arguments": {}}]
    for cut in range(len(whole)):  # every prefix: the calls complete in it, never a partial one
        got = call_values(parse_forced(whole[:cut]))
        want = [("add", {"a": 2, "s": '}]"'})] if cut >= whole.index("} ,") + 1 else []
        assert got == (want + [("noop", {})] if cut >= len(whole) - 1 else want), (cut, whole[:cut])
    assert call_values(parse_forced('[{"name": "add", "arguments": {"a": 2}}, {"name": 5')) == [("add", {"a": 2})]
    assert parse_forced('[{"nome": "add"}, ') == []  # a complete item that is not a call: nothing


def _budget_run(pieces: list[tuple[str, int]], max_new: int) -> tuple[str, bool]:
    """Feed (text, tokens) deltas to a CallsBudget; (text released, stopped)."""
    from batonlm.tool_calls.forced import CallsBudget

    budget = CallsBudget([], max_new)
    out, tokens = "", 0
    for text, n in pieces:
        tokens += n
        out += budget.feed(text, True, tokens)
        if budget.stopped:
            break
    return out, budget.stopped


CALL = '{"name": "add", "arguments": {"a": 2}}'


def test_calls_budget_ends_the_array_when_the_next_call_cannot_fit():
    # Each call is 10 one-token pieces; the array's "[" and "," take one token each.
    pieces = [("[", 1)] + [(c, 1) for c in _split(CALL, 10)] + [(",", 1)] + [(c, 1) for c in _split(CALL, 10)] + [("]", 1)]
    # Room for both calls and the bracket: nothing stops.
    assert _budget_run(pieces, 40) == ("[" + CALL + "," + CALL + "]", False)
    # After the first call (11 tokens used) 11 are left: fewer than its 11 and a bracket. It ends there.
    text, stopped = _budget_run(pieces, 22)
    assert stopped and text == "[" + CALL and call_values(parse_forced(text)) == [("add", {"a": 2})]
    # A brace inside a string is not the end of a call.
    tricky = '{"name": "add", "arguments": {"s": "}}}"}}'
    text, stopped = _budget_run([("[", 1), (tricky[:20], 1), (tricky[20:], 1)], 4)
    assert stopped and text == "[" + tricky
    text, stopped = _budget_run([("[", 1), (tricky[:20], 1)], 4)
    assert not stopped


def _split(text: str, n: int) -> list[str]:
    step = -(-len(text) // n)
    return [text[i : i + step] for i in range(0, len(text), step)]


def test_json_prefixes():
    """What a stream may announce a call's arguments on: a prefix of some valid JSON object."""
    from batonlm.tool_calls.streaming import arguments_so_far, is_json_prefix

    whole = '{"city": "Par\\u00eds \\"x\\"", "days": [1, -2.5e3, true, false, null], "o": {}}'
    assert all(is_json_prefix(whole[:n]) for n in range(1, len(whole) + 1))
    for bad in ('{broken', '{"a" 1', '{"a": 1}}', '{"a": tx', '{"a": 1 2', '{"a": [1}', '{,'):
        assert not is_json_prefix(bad), bad
    assert not arguments_so_far("{") and arguments_so_far('{"') and arguments_so_far("{}")
    assert not arguments_so_far('["a"]')


def test_forced_calls_stream_as_they_are_written():
    from batonlm.tool_calls.forced import partial_forced
    from batonlm.tool_calls.streaming import IncrementalCalls

    text = '[{"name": "add", "arguments": {"a": 2, "s": "x}"}}, {"name": "noop", "arguments": {}}]'
    calls, deltas = IncrementalCalls(), []
    for n in range(1, len(text) + 1):
        deltas += calls.update(partial_forced(text[:n]))
    last, final = calls.finish(parse_forced(text))
    assert not last and call_values(final) == [("add", {"a": 2, "s": "x}"}), ("noop", {})]
    assert [d.name for d in deltas if d.name] == ["add", "noop"]
    assert "".join(d.arguments for d in deltas if d.index == 0) == '{"a": 2, "s": "x}"}' == final[0].arguments
    single = '{"name": "add", "arguments": {"a": 2}}'
    assert partial_forced(single[:-1])[0].done and not partial_forced(single[:-3])[0].done
