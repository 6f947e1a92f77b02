"""The bytes and display text of single tokens, for logprobs (OpenAI's `token` and `bytes`)."""

from __future__ import annotations

import functools
import re
from typing import Any

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@functools.lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    # GPT-2's reversible byte -> printable-character map, inverted.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class TokenBytes:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = str(getattr(backend, "decoder", "") or "")
        self.byte_level = "ByteLevel" in decoder
        self._cache: dict[int, bytes] = {}

    def bytes(self, token_id: int) -> bytes:
        cached = self._cache.get(token_id)
        if cached is not None:
            return cached
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            out = b""
        elif self.byte_level:
            table = _byte_level_decoder()
            out = bytes(table[c] for c in piece if c in table) if all(c in table for c in piece) else piece.encode()
        elif m := _BYTE_TOKEN.match(piece):
            out = bytes([int(m.group(1), 16)])
        else:
            out = piece.replace("▁", " ").encode("utf-8")
        self._cache[token_id] = out
        return out

    def text(self, token_id: int) -> str:
        """The token as text; a partial UTF-8 sequence is shown OpenAI's way, as `bytes:\\xNN`."""
        raw = self.bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
