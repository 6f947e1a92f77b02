"""What a parsed completion is, and the parser interface every format implements (streaming:
`streaming.py`)."""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batonlm.tool_calls.streaming import PartialCall


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


@dataclass
class ParsedOutput:
    content: str
    calls: list[ToolCall]


def call_from_object(obj: object, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall | None:
    """{"name": ..., "arguments" | "parameters": {...}} as a ToolCall; None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args: object = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def json_values(text: str) -> list[object] | None:
    """Every JSON value in `text`, one after another (separated by whitespace, commas or
    semicolons); None if anything else is there."""
    decoder, i = json.JSONDecoder(), 0
    values: list[object] = []
    while True:
        while i < len(text) and text[i] in " \t\r\n,;":
            i += 1
        if i == len(text):
            return values
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        values.append(value)


# A request's tools: function name -> its parameters' JSON schema (formats that write
# arguments as text, not JSON, read their types from it).
ToolSchemas = dict[str, dict]


class ToolCallParser(ABC):
    """A model's tool-call format. `start_markers`: text that begins the calls part (what
    streaming holds back once seen, or while a prefix of one ends the text so far); with
    `anchored`, only at the start of the completion (a format whose calls are the whole output)."""

    name: str
    start_markers: tuple[str, ...]
    anchored: bool = False
    # Its markers are special tokens, which the detokenizer must then keep (gpt-oss's harmony).
    keeps_special_tokens: bool = False

    @abstractmethod
    def parse(self, text: str, tools: ToolSchemas | None = None) -> ParsedOutput:
        """Split a whole completion into its content and its calls (text that looks like a call
        but does not parse stays content)."""

    def partial(self, text: str, tools: ToolSchemas | None = None) -> list[PartialCall] | None:
        """The calls of the text so far, as far as they are written (`streaming.py`); None:
        this format's calls come whole at the end."""
        return None
