"""Incremental detokenization that never emits half a UTF-8 character.

The concatenated deltas equal decode(prompt + output) minus decode(prompt): decoding starts from
the prompt's last few tokens, so a completion keeps its leading space (SentencePiece drops it
when a sequence is decoded on its own). Fast tokenizers stream through the tokenizers
library's DecodeStream (a few microseconds a token); others re-decode a short window per token.
"""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# Prompt tokens kept as left context; enough for any merge to settle.
PROMPT_CONTEXT_TOKENS = 6
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._context = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self._output: list[int] = []
        self.text = ""
        self._backend: Tokenizer | None = getattr(tokenizer, "backend_tokenizer", None)
        self._stream: DecodeStream | None = None
        # DecodeStream cannot start after a prompt that ends inside a UTF-8 character (it would
        # emit the prompt again); the window method slices such a prefix correctly.
        if self._backend is not None and not self._ends_mid_character():
            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens, ids=self._context)
        # The window method's state: tokens[prefix_offset:read_offset] was last emitted.
        self._prefix_offset = 0
        self._read_offset = len(self._context)

    def _ends_mid_character(self) -> bool:
        return self._decode(self._context).endswith(REPLACEMENT_CHAR)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the newly completed text (possibly empty)."""
        self._output.extend(token_ids)
        if self._stream is not None and self._backend is not None:  # a stream is made only with a backend
            try:
                pieces = [self._stream.step(self._backend, t) for t in token_ids]
                delta = "".join(p for p in pieces if p)
            except Exception:
                # DecodeStream gives up on some invalid byte-fallback sequences (seen with
                # random-weight models); carry on with the window method from here.
                delta = self._switch_to_window(len(token_ids))
        else:
            delta = self._add_windowed()
        self.text += delta
        return delta

    def _switch_to_window(self, new_tokens: int) -> str:
        """Decode the tokens just added (and go on) with the window method."""
        self._stream = None
        self._read_offset = len(self._context) + len(self._output) - new_tokens
        self._prefix_offset = max(0, self._read_offset - PROMPT_CONTEXT_TOKENS)
        return self._add_windowed()

    def _add_windowed(self) -> str:
        tokens = self._context + self._output
        prefix = self._decode(tokens[self._prefix_offset : self._read_offset])
        full = self._decode(tokens[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT_CHAR):
            return ""  # nothing new, or a character still incomplete
        self._prefix_offset, self._read_offset = self._read_offset, len(tokens)
        return full[len(prefix) :]

    def flush(self) -> str:
        """At the end of generation: whatever is still held back (an incomplete character
        decodes to U+FFFD, as the tokenizer itself decodes it)."""
        full = self._decode(self._context + self._output)[len(self._decode(self._context)) :]
        delta = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text += delta
        return delta
