"""Loading a Hugging Face tokenizer with a clear error."""

from __future__ import annotations

from typing import Any


class TokenizerLoadError(ValueError):
    pass


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:
        raise TokenizerLoadError(f"could not load a tokenizer from {path!r}: {type(e).__name__}: {e}") from e
