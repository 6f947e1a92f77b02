"""What a parsed completion is, the parser interface, and the streaming wrapper every format
shares: text is streamed as it comes until a call may be starting, then held back until the end."""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field


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


class ToolCallParser(ABC):
    """A model's tool-call format. `start_markers`: text that begins the calls part (what
    streaming holds back once seen, or while a prefix of one ends the text so far)."""

    name: str
    start_markers: tuple[str, ...]

    @abstractmethod
    def parse(self, text: str) -> ParsedOutput:
        """Split a whole completion into its content and its calls (text that looks like a call
        but does not parse stays content)."""


class StreamingToolCalls:
    """Feeds a stream of text deltas through a parser: `feed` returns the content that can be
    sent now; `finish` returns the rest of the content and the calls."""

    def __init__(self, parser: ToolCallParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent = 0  # characters of `text` already sent as content
        self.holding = False  # a start marker was seen: everything after it waits for the end

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.holding:
            return ""
        starts = [i for i in (self.text.find(m, self.sent) for m in self.parser.start_markers) if i >= 0]
        if starts:
            self.holding = True
            out, self.sent = self.text[self.sent : min(starts)], min(starts)
            return out
        # Hold back a tail that could be the beginning of a marker split across deltas.
        keep = max((k for m in self.parser.start_markers for k in range(1, len(m))
                    if self.text.endswith(m[:k])), default=0)
        end = len(self.text) - keep
        out, self.sent = self.text[self.sent : end], max(self.sent, end)
        return out

    def finish(self) -> ParsedOutput:
        """What is left: the unsent content, and the calls of the whole text."""
        parsed = self.parser.parse(self.text)
        if not parsed.calls:
            return ParsedOutput(self.text[self.sent :], [])
        # Content before the calls was sent already, up to `sent`.
        return ParsedOutput(parsed.content[self.sent :] if len(parsed.content) > self.sent else "", parsed.calls)
