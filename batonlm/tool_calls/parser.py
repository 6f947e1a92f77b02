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


class StreamingToolCalls:
    """Feeds a stream of text deltas through a parser: `feed` returns the content that can be
    sent now; `finish` returns the rest of the content and the calls."""

    def __init__(self, parser: ToolCallParser, tools: ToolSchemas | None = None) -> None:
        self.parser = parser
        self.tools = tools
        self.text = ""
        self.sent = 0  # characters of `text` already sent as content
        self.holding = False  # a start marker was seen: everything after it waits for the end

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.holding:
            return ""
        if self.parser.anchored:
            return self._feed_anchored()
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

    def _feed_anchored(self) -> str:
        """Calls only at the start: hold while the text (less leading space) may begin with a
        marker; once it cannot, everything is content."""
        head = self.text.lstrip()
        if any(head.startswith(m) for m in self.parser.start_markers):
            self.holding = True
            return ""
        if self.sent == 0 and any(m.startswith(head) for m in self.parser.start_markers):
            return ""  # too short to tell
        out, self.sent = self.text[self.sent :], len(self.text)
        return out

    def finish(self) -> ParsedOutput:
        """What is left: the unsent content, and the calls of the whole text."""
        parsed = self.parser.parse(self.text, self.tools)
        # Content was sent already up to `sent` (before the calls, or before a format's content
        # that the parse rewrites, as harmony's final channel).
        return ParsedOutput(parsed.content[self.sent :], parsed.calls)
