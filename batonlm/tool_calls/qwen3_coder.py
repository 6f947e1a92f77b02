"""Qwen3-Coder's XML tool calls:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Parameters are text, read as the values their schema in the request's tools says
(`typed_values.py`)."""

from __future__ import annotations

import json
import re

from batonlm.tool_calls.parser import ParsedOutput, ToolCall, ToolCallParser, ToolSchemas
from batonlm.tool_calls.streaming import PartialCall
from batonlm.tool_calls.typed_values import typed_value

_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)
_FUNCTION_START = re.compile(r"<function=([^>\n]+)>")
_WRAPPER = re.compile(r"\s*(</?tool_call>\s*)*")


class Qwen3CoderParser(ToolCallParser):
    name = "qwen3_coder"
    start_markers = ("<tool_call>", "<function=")

    def parse(self, text: str, tools: ToolSchemas | None = None) -> ParsedOutput:
        starts = [i for i in (text.find(m) for m in self.start_markers) if i >= 0]
        if not starts:
            return ParsedOutput(text, [])
        start = min(starts)
        calls, at = [], start
        for m in _FUNCTION.finditer(text, start):
            if not _WRAPPER.fullmatch(text, at, m.start()):  # only the wrappers between calls
                return ParsedOutput(text, [])
            name = m.group(1).strip()
            props = ((tools or {}).get(name) or {}).get("properties") or {}
            body = m.group(2)
            args = {}
            for p in _PARAMETER.finditer(body):
                key = p.group(1).strip()
                value = p.group(2).removeprefix("\n").removesuffix("\n")
                args[key] = typed_value(value, props.get(key))
            if _PARAMETER.sub("", body).strip():  # text that is no parameter: not a call
                return ParsedOutput(text, [])
            calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
            at = m.end()
        if not calls or not _WRAPPER.fullmatch(text, at):
            return ParsedOutput(text, [])
        return ParsedOutput(text[:start].rstrip(), calls)

    def partial(self, text: str, tools: ToolSchemas | None = None) -> list[PartialCall]:
        """Each function's arguments as JSON built from its complete parameters (the same text
        the whole parse writes: json.dumps's separators), closed at </function>."""
        calls: list[PartialCall] = []
        for m in _FUNCTION_START.finditer(text):
            if not re.compile(r"\s*(<parameter=|</function>)").match(text, m.end()):
                break  # not (yet) a function's body: nothing to announce
            name = m.group(1).strip()
            body, done_at = text[m.end() :], text.find("</function>", m.end())
            body = body if done_at < 0 else text[m.end() : done_at]
            props = ((tools or {}).get(name) or {}).get("properties") or {}
            items = [json.dumps(p.group(1).strip(), ensure_ascii=False) + ": " + json.dumps(
                typed_value(p.group(2).removeprefix("\n").removesuffix("\n"), props.get(p.group(1).strip())),
                ensure_ascii=False) for p in _PARAMETER.finditer(body)]
            args = "{" + ", ".join(items) + ("}" if done_at >= 0 else "")
            calls.append(PartialCall(name, args, done_at >= 0))
            if done_at < 0:
                break
        return calls
