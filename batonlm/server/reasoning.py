"""`--reasoning-parser`: models that think in `<think>…</think>` before they answer. The
thinking goes to `message.reasoning_content` (streamed: `delta.reasoning_content`), the rest to
`content` (and from there to the tool-call parser).

* `qwen3`: the reasoning is the `<think>…</think>` block the output starts with, if it does
  (with thinking turned off there is none).
* `deepseek-r1`: the chat template opens the block in the prompt, so the output starts inside it:
  everything up to `</think>` is reasoning (all of it, if the tag never comes).
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"
REASONING_PARSERS = ("none", "qwen3", "deepseek-r1")


def _partial_suffix(text: str, tag: str) -> int:
    """How many trailing characters of `text` could be the start of `tag`."""
    return max((k for k in range(1, len(tag)) if text.endswith(tag[:k])), default=0)


class ReasoningStream:
    """Splits a stream of text deltas into (reasoning, content) deltas; a tag split across
    deltas is held back until it is whole."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        # qwen3: not known yet whether the output opens a block; r1: inside one from the start.
        self.state = "inside" if kind == "deepseek-r1" else "start"
        self.buffer = ""
        self.emitted = False  # any reasoning text yet (the newline after the tag is dropped)
        self.strip_newlines = False

    def feed(self, delta: str) -> tuple[str, str]:
        self.buffer += delta
        reasoning, content = "", ""
        while True:
            if self.state == "start":
                stripped = self.buffer.lstrip()
                if stripped.startswith(OPEN):
                    self.buffer, self.state = stripped[len(OPEN):], "inside"
                    continue
                if OPEN.startswith(stripped):  # maybe the tag, not whole yet
                    return reasoning, content
                self.state = "after"
            if self.state == "inside":
                if not self.emitted:
                    self.buffer = self.buffer.lstrip("\n")
                end = self.buffer.find(CLOSE)
                if end >= 0:
                    reasoning += self.buffer[:end]
                    self.buffer, self.state = self.buffer[end + len(CLOSE):], "after"
                    self.strip_newlines = True  # the newlines after the block, whatever delta brings them
                    continue
                keep = _partial_suffix(self.buffer, CLOSE)
                cut = len(self.buffer) - keep
                reasoning += self.buffer[:cut]
                self.emitted = self.emitted or cut > 0
                self.buffer = self.buffer[cut:]
                return reasoning, content
            if self.strip_newlines:
                self.buffer = self.buffer.lstrip("\n")
                self.strip_newlines = not self.buffer
            content += self.buffer
            self.buffer = ""
            return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is held back: a partial tag was text after all."""
        rest, self.buffer = self.buffer, ""
        return (rest, "") if self.state == "inside" else ("", rest)


def split_reasoning(kind: str, text: str) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole completion."""
    stream = ReasoningStream(kind)
    r1, c1 = stream.feed(text)
    r2, c2 = stream.finish()
    reasoning = r1 + r2
    return reasoning or None, c1 + c2
