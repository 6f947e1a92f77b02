"""The tool-call formats of the model families batonlm serves, and how one is picked."""

from __future__ import annotations

import json
import re

from batonlm.tool_calls.parser import (
    ParsedOutput,
    ToolCall,
    ToolCallParser,
    ToolSchemas,
    call_from_object,
    json_values,
)
from batonlm.tool_calls.streaming import PartialCall, arguments_so_far, call_objects, json_value


class HermesParser(ToolCallParser):
    """Hermes / Qwen 2.5 / Qwen 3: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, repeated."""

    name = "hermes"
    start_markers = ("<tool_call>",)
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)

    def parse(self, text: str, tools: ToolSchemas | None = None) -> ParsedOutput:
        start = text.find("<tool_call>")
        if start < 0:
            return ParsedOutput(text, [])
        calls = []
        for body in self._CALL.findall(text[start:]):
            try:
                call = call_from_object(json.loads(body))
            except json.JSONDecodeError:
                call = None
            if call is None:
                return ParsedOutput(text, [])
            calls.append(call)
        return ParsedOutput(text[:start].rstrip(), calls) if calls else ParsedOutput(text, [])

    def partial(self, text: str, tools: ToolSchemas | None = None) -> list[PartialCall]:
        calls: list[PartialCall] = []
        at = text.find("<tool_call>")
        while at >= 0:
            call = call_objects(text, at + len("<tool_call>"))[:1]
            calls += call
            if not call or not call[0].done:
                break
            at = text.find("<tool_call>", at + 1)
        return calls


class Llama3Parser(ToolCallParser):
    """Llama 3.1+ JSON tool calls: `{"name": ..., "parameters": {...}}` as the whole message
    (optionally after `<|python_tag|>`), several separated by `;`."""

    name = "llama3"
    start_markers = ("<|python_tag|>", '{"name"', '{ "name"')

    def parse(self, text: str, tools: ToolSchemas | None = None) -> ParsedOutput:
        body = text.strip()
        prefix = ""
        tag = body.find("<|python_tag|>")
        if tag >= 0:
            prefix, body = body[:tag].rstrip(), body[tag + len("<|python_tag|>") :]
        elif not body.startswith("{"):
            return ParsedOutput(text, [])
        values = json_values(body)
        calls = [call_from_object(v) for v in values or []]
        valid = [c for c in calls if c is not None]
        if not calls or len(valid) < len(calls):
            return ParsedOutput(text, [])
        return ParsedOutput(prefix, valid)

    def partial(self, text: str, tools: ToolSchemas | None = None) -> list[PartialCall]:
        tag = text.find("<|python_tag|>")
        at = tag + len("<|python_tag|>") if tag >= 0 else len(text) - len(text.lstrip())
        return call_objects(text, at, ";")


class MistralParser(ToolCallParser):
    """Mistral: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (v3), or
    `[TOOL_CALLS]name[ARGS]{...}` for each call (v11)."""

    name = "mistral"
    start_markers = ("[TOOL_CALLS]",)

    def parse(self, text: str, tools: ToolSchemas | None = None) -> ParsedOutput:
        start = text.find("[TOOL_CALLS]")
        if start < 0:
            return ParsedOutput(text, [])
        content, rest = text[:start].rstrip(), text[start:]
        calls: list[ToolCall | None] = []
        if "[ARGS]" in rest:
            for part in rest.split("[TOOL_CALLS]")[1:]:
                name, _, args = part.partition("[ARGS]")
                values = json_values(args)
                calls.append(call_from_object({"name": name.strip(), "arguments": values[0]})
                             if values and len(values) == 1 else None)
        else:
            values = json_values(rest[len("[TOOL_CALLS]") :])
            items = values[0] if values and len(values) == 1 and isinstance(values[0], list) else values
            calls = [call_from_object(v) for v in items or []]
        valid = [c for c in calls if c is not None]
        if not calls or len(valid) < len(calls):
            return ParsedOutput(text, [])
        return ParsedOutput(content, valid)

    def partial(self, text: str, tools: ToolSchemas | None = None) -> list[PartialCall]:
        start = text.find("[TOOL_CALLS]")
        rest = text[start + len("[TOOL_CALLS]") :] if start >= 0 else ""
        if rest.lstrip().startswith("["):  # v3: an array of call objects
            return call_objects(rest, rest.index("[") + 1, ",")
        calls: list[PartialCall] = []
        for part in rest.split("[TOOL_CALLS]"):  # v11: name[ARGS]{...} per call
            name, sep, args = part.partition("[ARGS]")
            if not sep:
                break
            value, end = json_value(args, 0)
            if not arguments_so_far(value):
                break
            calls.append(PartialCall(name.strip(), value, end is not None))
        return calls


# Model architecture -> the format its chat template and fine-tuning use.
_BY_ARCHITECTURE = {"LlamaForCausalLM": "llama3", "MistralForCausalLM": "mistral", "MixtralForCausalLM": "mistral",
                    "GptOssForCausalLM": "harmony", "DeepseekV3ForCausalLM": "deepseek_v3",
                    "Llama4ForConditionalGeneration": "pythonic", "Llama4ForCausalLM": "pythonic"}
# Text in a chat template that gives its format away (one architecture, several formats: Qwen3
# MoE is Qwen3's hermes, or Qwen3-Coder's XML).
_BY_TEMPLATE = (("<parameter=", "qwen3_coder"), ("<｜tool▁calls▁begin｜>", "deepseek_v3"), ("<|channel|>", "harmony"))


def parser_for(choice: str, architecture: str | None, chat_template: str | None = None) -> ToolCallParser:
    """`--tool-call-parser`: a format's name, or auto (from the chat template's tool-call
    markers, then the architecture; hermes otherwise, which Qwen models and most other
    tool-tuned models use)."""
    from batonlm.registries import TOOL_CALL_PARSERS

    name = choice
    if choice == "auto":
        by_template = next((n for marker, n in _BY_TEMPLATE if marker in (chat_template or "")), None)
        name = by_template or _BY_ARCHITECTURE.get(architecture or "", "hermes")
    return TOOL_CALL_PARSERS[name]()
