"""Stop strings for a stream of text deltas: trimmed from the output, even across tokens.

Text that might be the start of a stop string is held back until it is known not to be, so a
client never sees a stop string, or part of one.
"""

from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def feed(self, delta: str, armed: bool = True, tokens: int = 0) -> str:
        """Add generated text; return what can be released. After a match, `stopped` is True
        and nothing more is released. Text fed unarmed (a request still under its min_tokens)
        is released as it is: stop strings are matched in what follows it (as vLLM does).
        `tokens` (the completion's tokens so far) is for subclasses that stop on other rules."""
        if self.stopped or not self.stops:
            return "" if self.stopped else delta
        if not armed:
            out, self._held = self._held + delta, ""
            return out
        text = self._held + delta
        found = [(i, s) for s in self.stops if (i := text.find(s)) >= 0]
        if found:
            cut, self.matched = min(found, key=lambda f: f[0])  # the earliest; of two there, the first given
            self.stopped = True
            self._held = ""
            return text[:cut]
        keep = self._longest_partial(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """At the end of generation: release what was held back (no stop string completed)."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out

    def _longest_partial(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
