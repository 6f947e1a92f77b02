"""gpt-oss's harmony format: the completion is messages on channels, each a header, then
`<|message|>` and its body, ended by `<|end|>`, `<|call|>` or `<|return|>`:

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

A message addressed `to=functions.NAME` (in its header, before or after the channel) is a call
with its body as the arguments; the `final` channel's bodies are the content; the `analysis`
channel (the model's reasoning) is not content and is left out. Its markers are special
tokens, which the detokenizer keeps for this format (`keeps_special_tokens`)."""

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

_ENDS = re.compile(r"<\|(?:end|call|return)\|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_RECIPIENT = re.compile(r"to=functions\.([\w\-.]+)")


class HarmonyParser(ToolCallParser):
    name = "harmony"
    start_markers = ("<|channel|>", "<|start|>")
    keeps_special_tokens = True

    def parse(self, text: str, tools: ToolSchemas | None = None) -> ParsedOutput:
        if "<|message|>" not in text:
            return ParsedOutput(text, [])
        content: list[str] = []
        calls: list[ToolCall] = []
        for part in text.split("<|start|>"):
            header, sep, body = part.partition("<|message|>")
            if not sep:
                if part.strip() and not _ENDS.fullmatch(part.strip()):
                    return ParsedOutput(text, [])  # text outside any message: not harmony
                continue
            body = _ENDS.split(body, maxsplit=1)[0]
            recipient = _RECIPIENT.search(header)
            channel = _CHANNEL.search(header)
            if recipient is not None:
                values = json_values(body)
                call = call_from_object({"name": recipient.group(1), "arguments": values[0]}) \
                    if values and len(values) == 1 else None
                if call is None:
                    return ParsedOutput(text, [])
                calls.append(call)
            elif channel is None or channel.group(1) == "final":
                content.append(body)
        return ParsedOutput("".join(content), calls)

    def partial(self, text: str, tools: ToolSchemas | None = None) -> list[PartialCall]:
        calls: list[PartialCall] = []
        for part in text.split("<|start|>"):
            header, sep, body = part.partition("<|message|>")
            recipient = _RECIPIENT.search(header) if sep else None
            if recipient is None:
                continue
            value, end = json_value(body, 0)
            if not arguments_so_far(value):
                break
            calls.append(PartialCall(recipient.group(1), value, end is not None))
            if end is None:
                break
        return calls
