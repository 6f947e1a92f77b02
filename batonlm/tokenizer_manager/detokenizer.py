"""Incremental detokenization that never emits half a UTF-8 character.

The concatenated deltas equal decode(prompt + output) minus decode(prompt): decoding starts from
the prompt's last few tokens, so a completion keeps its leading space (SentencePiece drops it
when a sequence is decoded on its own).
"""

from __future__ import annotations

from typing import Any

# Prompt tokens kept as left context; enough for any merge to settle.
PROMPT_CONTEXT_TOKENS = 6
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._tokens = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the newly completed text (possibly empty)."""
        self._tokens.extend(token_ids)
        prefix = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        full = self._decode(self._tokens[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT_CHAR):
            return ""  # nothing new, or a character still incomplete
        delta = full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of generation: whatever is still held back (an incomplete character
        decodes to U+FFFD, as the tokenizer itself decodes it)."""
        prefix = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        full = self._decode(self._tokens[self._prefix_offset :])
        delta = full[len(prefix) :] if len(full) > len(prefix) else ""
        self._prefix_offset = self._read_offset = len(self._tokens)
        self.text += delta
        return delta
