"""Tool calls in a stream: content goes out as it comes until a call may be starting (a
format's start marker, or a prefix of one ending the text so far), then is held back; calls go
out as they are written: a call's id and name once its name is complete, then its arguments'
JSON text as deltas, so that a client sees each call grow and never a piece of one as content.

A format that can (`ToolCallParser.partial`) reads the calls part of the text so far as
`PartialCall`s: each name, the JSON text of its arguments so far (only ever growing: each
reading's text starts with the last one's), and whether they are complete. `IncrementalCalls`
turns successive readings into `CallDelta`s. At the end the whole text's parse decides: a call
streamed is completed with the rest of its arguments (a streamed call's arguments are the text
streamed, which parses to the same value), one not streamed comes whole."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from batonlm.tool_calls.parser import ParsedOutput, ToolCall, ToolCallParser, ToolSchemas


@dataclass(frozen=True)
class PartialCall:
    name: str
    arguments: str  # the JSON text of its arguments so far
    done: bool  # the arguments are complete


@dataclass(frozen=True)
class CallDelta:
    index: int  # of the call, among the choice's calls
    id: str
    name: str | None  # with the call's first delta only
    arguments: str  # more of its arguments' JSON text


class IncrementalCalls:
    def __init__(self) -> None:
        self.sent: list[tuple[str, str, str]] = []  # (id, name, arguments sent) per call announced

    def update(self, partial: list[PartialCall]) -> list[CallDelta]:
        """The deltas from the calls read so far (a reading that contradicts what was sent is
        ignored: the end decides)."""
        out: list[CallDelta] = []
        for k, call in enumerate(partial):
            if k == len(self.sent):
                call_id = ToolCall(call.name, "").id
                self.sent.append((call_id, call.name, ""))
                out.append(CallDelta(k, call_id, call.name, ""))
            call_id, name, args = self.sent[k]
            if name != call.name or not call.arguments.startswith(args):
                break
            if len(call.arguments) > len(args):
                self.sent[k] = (call_id, name, call.arguments)
                out.append(CallDelta(k, call_id, None, call.arguments[len(args) :]))
        return out

    def finish(self, calls: list[ToolCall]) -> tuple[list[CallDelta], list[ToolCall]]:
        """The last deltas, and the calls as they went out (ids and arguments as streamed)."""
        out: list[CallDelta] = []
        final: list[ToolCall] = []
        for k, call in enumerate(calls):
            if k >= len(self.sent):  # not streamed (a format read whole, or a call written at once)
                out += [CallDelta(k, call.id, call.name, ""), CallDelta(k, call.id, None, call.arguments)]
                final.append(call)
                continue
            call_id, name, args = self.sent[k]
            full = args if _same(args, call.arguments) else call.arguments
            if full.startswith(args) and len(full) > len(args):
                out.append(CallDelta(k, call_id, None, full[len(args) :]))
            final.append(ToolCall(call.name, full if full.startswith(args) else args, call_id))
        return out, final


def _same(text: str, other: str) -> bool:
    try:
        return bool(text) and json.loads(text) == json.loads(other)
    except json.JSONDecodeError:
        return False


def json_value(text: str, at: int) -> tuple[str, int | None]:
    """The JSON value starting at `at` (after whitespace): its text so far, and where it ends
    (None: not complete yet)."""
    while at < len(text) and text[at] in " \t\r\n":
        at += 1
    depth, in_string, escaped, start = 0, False, False, at
    for i in range(at, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if depth == 0:
                    return text[start : i + 1], i + 1
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
            if depth == 0:
                return text[start : i + 1], i + 1
            if depth < 0:
                return text[start:i], None
    return text[start:], None


_OBJECT_START = re.compile(r"\{\s*[\"}]")


def arguments_so_far(text: str) -> bool:
    """Whether `text` can begin the JSON object of a call's arguments (what a stream may announce
    a call on): an object begun (its first key, or its end), and a prefix of some valid JSON."""
    return _OBJECT_START.match(text) is not None and is_json_prefix(text)


def is_json_prefix(text: str) -> bool:
    """Whether some text after `text` makes it valid JSON: the open string and brackets closed,
    after the partial token at the end (a literal, number, escape, or a key waiting for its
    value) is completed."""
    stack: list[str] = []
    in_string = escaped = False
    unicode_left = 0
    for ch in text:
        if in_string:
            if unicode_left:
                unicode_left -= 1
            elif escaped:
                escaped = False
                unicode_left = 4 if ch == "u" else 0
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            stack.append("]" if ch == "[" else "}")
        elif ch in "]}":
            if not stack or stack.pop() != ch:
                return False
    closers = "".join(reversed(stack))
    if in_string:
        tail = ("0" * unicode_left) + ("n" if escaped and not unicode_left else "") + '"'
        endings = [tail + ": null" + closers, tail + closers]  # a key, or a value
    else:
        endings = [e + closers for e in ("", "null", "0", ": null", ' "": null', "e", "ue", "rue", "alse", "lse", "se", "ull", "ll",
                                         "l", "1", "0}")]
    stripped = text.rstrip()
    before = stripped[:-1].rstrip()  # a comma after a value: what follows it is a value or key
    bases = [text] + ([before] if stripped.endswith(",") and before and before[-1] not in "{[,:" else [])
    for base in bases:
        for ending in endings:
            try:
                json.loads(base + ending)
                return True
            except json.JSONDecodeError:
                continue
    return False


# A call object as JSON formats write it: {"name": "...", "arguments" | "parameters": <value>
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def call_objects(text: str, at: int, separators: str = ",;") -> list[PartialCall]:
    """JSON call objects one after another from `at` (separated by whitespace or
    `separators`), as far as they have been written; a call whose name is not complete, or
    whose arguments do not start with an object, is not read yet."""
    calls: list[PartialCall] = []
    while True:
        m = _CALL_HEAD.match(text, at)
        if m is None:
            return calls
        args, end = json_value(text, m.end())
        if not arguments_so_far(args):
            return calls
        calls.append(PartialCall(json.loads(f'"{m.group(1)}"'), args, end is not None))
        if end is None:
            return calls
        close = re.compile(r"\s*\}").match(text, end)  # the object's own closing brace
        if close is None:
            return calls
        at = close.end()
        sep = re.compile(rf"\s*[{re.escape(separators)}]?\s*").match(text, at)
        at = sep.end() if sep else at


class StreamingToolCalls:
    """Feeds a stream of text deltas through a parser: `feed` returns the content that can be
    sent now, `deltas` the calls' progress since (formats that read partial calls); `finish`
    returns the rest of the content, the calls, and their last deltas."""

    def __init__(self, parser: ToolCallParser, tools: ToolSchemas | None = None) -> None:
        self.parser = parser
        self.tools = tools
        self.text = ""
        self.sent = 0  # characters of `text` already sent as content
        self.holding = False  # a start marker was seen: everything after it waits for the end
        self.incremental = IncrementalCalls()

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

    def deltas(self) -> list[CallDelta]:
        if not self.holding:
            return []
        partial = self.parser.partial(self.text, self.tools)
        return self.incremental.update(partial) if partial is not None else []

    def finish(self) -> tuple[ParsedOutput, list[CallDelta]]:
        """What is left: the unsent content, the calls of the whole text (as streamed), and the
        deltas that complete them."""
        parsed = self.parser.parse(self.text, self.tools)
        deltas, calls = self.incremental.finish(parsed.calls)
        # Content was sent already up to `sent` (before the calls, or before a format's content
        # that the parse rewrites, as harmony's final channel).
        return ParsedOutput(parsed.content[self.sent :], calls), deltas
