"""The tool-call formats of current models on recorded outputs: Qwen3-Coder's XML (parameters
typed by the request's schemas), pythonic calls (Llama 3.2 / 4, Gemma), DeepSeek-V3 and V3.1, and
gpt-oss's harmony channels; whole, and streamed in pieces split anywhere (never a piece of a
call sent as content); and how auto picks a format."""

from __future__ import annotations

import random

import pytest
from tool_call_checks import assert_deltas_build, call_values, stream_in_pieces

from batonlm.tool_calls.deepseek import DeepSeekV3Parser
from batonlm.tool_calls.formats import HermesParser, parser_for
from batonlm.tool_calls.harmony import HarmonyParser
from batonlm.tool_calls.pythonic import PythonicParser
from batonlm.tool_calls.qwen3_coder import Qwen3CoderParser
from batonlm.tool_calls.streaming import StreamingToolCalls

TOOLS = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                     "metric": {"type": "boolean"}, "zip": {"type": "string"}}},
    "plot": {"type": "object", "properties": {"points": {"type": "array"}, "style": {"type": "object"},
                                              "scale": {"type": ["number", "null"]}}},
}
PARIS = {"city": "Paris", "days": 3}

QWEN3_CODER_TWO = (
    "I'll look both up.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n<parameter=zip>\n75001\n</parameter>\n"
    "</function>\n</tool_call>\n<tool_call>\n<function=plot>\n<parameter=points>\n[[0, 1], [2, 3]]\n</parameter>\n"
    "<parameter=style>\n{'color': 'red'}\n</parameter>\n<parameter=scale>\n2.5\n</parameter>\n</function>\n</tool_call>"
)
DS = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"
DS_END = "<｜tool▁call▁end｜>"

QWEN3_CODER_CUT = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
CUT = {QWEN3_CODER_CUT}

# (parser, model output, content when streamed and whole, [(name, arguments)])
RECORDED = [
    (Qwen3CoderParser, QWEN3_CODER_TWO, "I'll look both up.",
     [("get_weather", {"city": "Paris", "days": 3, "metric": True, "zip": "75001"}),
      ("plot", {"points": [[0, 1], [2, 3]], "style": {"color": "red"}, "scale": 2.5})]),
    (Qwen3CoderParser, "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew\nYork\n</parameter>\n</function>\n"
     "</tool_call>", "", [("get_weather", {"city": "New\nYork"})]),
    (Qwen3CoderParser, "Use <function=x> carefully.", "Use <function=x> carefully.", []),
    (Qwen3CoderParser, QWEN3_CODER_CUT, QWEN3_CODER_CUT, []),  # cut: no call
    (PythonicParser, '[get_weather(city="Paris", days=3), plot(points=[[0, 1]], style={"c": None}, scale=null)]', "",
     [("get_weather", PARIS), ("plot", {"points": [[0, 1]], "style": {"c": None}, "scale": None})]),
    (PythonicParser, '<|python_start|>[get_weather(city="Paris", days=3)]<|python_end|>', "", [("get_weather", PARIS)]),
    (PythonicParser, "The list [1, 2] is short.", "The list [1, 2] is short.", []),
    (PythonicParser, "[1, 2, 3]", "[1, 2, 3]", []),
    (PythonicParser, '[get_weather("Paris")]', '[get_weather("Paris")]', []),  # positional: not a call
    (DeepSeekV3Parser, "Checking." + DS + 'function<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris", "days": 3}\n```'
     + DS_END + "<｜tool▁call▁begin｜>function<｜tool▁sep｜>plot\n```json\n{}\n```" + DS_END + "<｜tool▁calls▁end｜>",
     "Checking.", [("get_weather", PARIS), ("plot", {})]),
    (DeepSeekV3Parser, DS + 'get_weather<｜tool▁sep｜>{"city": "Paris", "days": 3}' + DS_END + "<｜tool▁calls▁end｜>"
     "<｜end▁of▁sentence｜>", "", [("get_weather", PARIS)]),
    (DeepSeekV3Parser, DS + "get_weather<｜tool▁sep｜>{broken" + DS_END, DS + "get_weather<｜tool▁sep｜>{broken" + DS_END, []),
    (HarmonyParser, "<|channel|>analysis<|message|>They want the weather.<|end|><|start|>assistant<|channel|>commentary "
     'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 3}<|call|>', "",
     [("get_weather", PARIS)]),
    (HarmonyParser, "<|channel|>analysis<|message|>Two calls.<|end|><|start|>assistant to=functions.get_weather"
     '<|channel|>commentary json<|message|>{"city": "Paris", "days": 3}<|call|><|start|>assistant<|channel|>commentary '
     "to=functions.plot<|message|>{}<|call|>", "", [("get_weather", PARIS), ("plot", {})]),
    (HarmonyParser, "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>"
     "It is sunny.<|return|>", "It is sunny.", []),
    (HarmonyParser, "Plain text, no channels.", "Plain text, no channels.", []),
]


@pytest.mark.parametrize(("cls", "text", "content", "calls"), RECORDED)
def test_recorded_outputs(cls, text, content, calls):
    parsed = cls().parse(text, TOOLS)
    assert (parsed.content, call_values(parsed.calls)) == (content, calls)
    assert len({c.id for c in parsed.calls}) == len(parsed.calls)


@pytest.mark.parametrize(("cls", "text", "content", "calls"), RECORDED)
def test_streamed_in_random_pieces(cls, text, content, calls):
    rng = random.Random(len(text))
    for _ in range(30):
        sent, deltas, rest = stream_in_pieces(cls(), text, rng, TOOLS)
        if text not in CUT:  # a call cut short by max_tokens was announced before the cut
            assert_deltas_build(deltas, rest.calls)
        assert (sent + rest.content).rstrip() == content.rstrip()
        assert call_values(rest.calls) == calls
        if calls:  # nothing of a call went out as content
            assert not any(m in sent for m in cls.start_markers if m != "[")
            assert "get_weather" not in sent


def test_content_streams_before_the_calls_and_a_pythonic_text_is_not_held():
    stream = StreamingToolCalls(PythonicParser())
    assert stream.feed("The list ") == "The list " and stream.feed("[1, 2]") == "[1, 2]"
    stream = StreamingToolCalls(PythonicParser())
    assert stream.feed(" [get_we") == "" and stream.feed('ather(city="Paris")]') == ""
    assert call_values(stream.finish()[0].calls) == [("get_weather", {"city": "Paris"})]
    stream = StreamingToolCalls(Qwen3CoderParser(), TOOLS)
    assert stream.feed("Sure, <func") == "Sure, " and stream.feed("tion=get_weather>") == ""


def test_auto_picks_the_format_from_the_template_then_the_architecture():
    assert isinstance(parser_for("auto", "Qwen3MoeForCausalLM", "{{ '<function=' }}<parameter=x>"), Qwen3CoderParser)
    assert isinstance(parser_for("auto", "Qwen3MoeForCausalLM", "{{ '<tool_call>' }}"), HermesParser)
    assert isinstance(parser_for("auto", "GptOssForCausalLM"), HarmonyParser)
    assert isinstance(parser_for("auto", "DeepseekV3ForCausalLM"), DeepSeekV3Parser)
    assert isinstance(parser_for("auto", None, "x <｜tool▁calls▁begin｜> y"), DeepSeekV3Parser)
    assert isinstance(parser_for("auto", "Llama4ForConditionalGeneration"), PythonicParser)
    assert isinstance(parser_for("pythonic", "Qwen3ForCausalLM"), PythonicParser)
    assert HarmonyParser.keeps_special_tokens and not HermesParser.keeps_special_tokens


@pytest.mark.parametrize(("cls", "text", "content", "calls"), [r for r in RECORDED if r[3] and r[0] is not PythonicParser])
def test_calls_stream_as_they_are_written(cls, text, content, calls):
    """A call goes out (its name) before the output ends, and its arguments grow in more than
    one delta: fed a character at a time, the first call's name is out before the last call's
    arguments are complete."""
    stream = StreamingToolCalls(cls(), TOOLS)
    seen = []  # (characters fed, delta)
    for n, ch in enumerate(text, 1):
        stream.feed(ch)
        seen += [(n, d) for d in stream.deltas()]
    first_name = next(n for n, d in seen if d.name is not None)
    assert first_name < len(text) - 10
    argument_deltas = [d for _, d in seen if d.index == 0 and d.arguments]
    assert len(argument_deltas) > 1
