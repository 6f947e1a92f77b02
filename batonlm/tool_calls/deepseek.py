"""DeepSeek-V3 / R1 tool calls, in either of its two layouts:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

and DeepSeek-V3.1's `<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>`."""

from __future__ import annotations

import re

from batonlm.tool_calls.parser import (
    ParsedOutput,
    ToolCall,
    ToolCallParser,
    ToolSchemas,
    call_from_object,
    json_values,
)
from batonlm.tool_calls.streaming import PartialCall, arguments_so_far, json_value

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_CALL = re.compile(re.escape(CALL_BEGIN) + r"(.*?)" + re.escape(CALL_END), re.S)
_OPEN_FENCE = re.compile(r"\s*```(?:json)?\s*\n")
_FENCE = re.compile(r"^\s*```(?:json)?\s*(.*?)\s*```\s*$", re.S)
_BETWEEN = re.compile(r"\s*(" + re.escape(CALLS_BEGIN) + "|" + re.escape(CALLS_END) + r"|<｜end▁of▁sentence｜>|\s)*")


class DeepSeekV3Parser(ToolCallParser):
    name = "deepseek_v3"
    start_markers = (CALLS_BEGIN, CALL_BEGIN)

    def parse(self, text: str, tools: ToolSchemas | None = None) -> ParsedOutput:
        starts = [i for i in (text.find(m) for m in self.start_markers) if i >= 0]
        if not starts:
            return ParsedOutput(text, [])
        start = min(starts)
        calls: list[ToolCall] = []
        at = start
        for m in _CALL.finditer(text, start):
            call = _call(m.group(1)) if _BETWEEN.fullmatch(text, at, m.start()) else None
            if call is None:
                return ParsedOutput(text, [])
            calls.append(call)
            at = m.end()
        if not calls or not _BETWEEN.fullmatch(text, at):
            return ParsedOutput(text, [])
        return ParsedOutput(text[:start].rstrip(), calls)

    def partial(self, text: str, tools: ToolSchemas | None = None) -> list[PartialCall]:
        calls: list[PartialCall] = []
        for body in text.split(CALL_BEGIN)[1:]:
            head, sep, rest = body.partition(SEP)
            if not sep:
                break
            name = head
            if head.strip() == "function":  # V3: the name's line, then a json fence
                name, newline, rest = rest.partition("\n")
                fence = _OPEN_FENCE.match(rest)
                if not newline or fence is None:
                    break
                rest = rest[fence.end() :]
            value, end = json_value(rest, 0)
            if not arguments_so_far(value):
                break
            calls.append(PartialCall(name.strip(), value, end is not None))
            if end is None:
                break
        return calls


def _call(body: str) -> ToolCall | None:
    head, sep, rest = body.partition(SEP)
    if not sep:
        return None
    if head.strip() == "function":  # V3: the name, then the arguments in a json fence
        name, _, rest = rest.partition("\n")
        fenced = _FENCE.match(rest)
        rest = fenced.group(1) if fenced else rest
    else:
        name = head
    values = json_values(rest)
    if not values or len(values) != 1:
        return None
    return call_from_object({"name": name.strip(), "arguments": values[0]})
