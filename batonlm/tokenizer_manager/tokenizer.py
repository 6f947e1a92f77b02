"""Loading a Hugging Face tokenizer with a clear error, without torch where possible.

`AutoTokenizer` imports transformers' config machinery, which imports torch (~250 MB in the
main process, which never computes a tensor). A tokenizer directory names its class
(`tokenizer_config.json`: `tokenizer_class`); that class is imported alone, as AutoTokenizer
would pick it (the fast variant first), and AutoTokenizer is the fallback for a directory that
does not name one transformers exports.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class TokenizerLoadError(ValueError):
    pass


def load_tokenizer(path: str) -> Any:
    try:
        cls = declared_class(path)
        if cls is not None:
            return cls.from_pretrained(path)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    except Exception as e:
        raise TokenizerLoadError(f"could not load a tokenizer from {path!r}: {type(e).__name__}: {e}") from e


def declared_class(path: str) -> Any:
    """The tokenizer class `tokenizer_config.json` names, as transformers exports it (its fast
    variant where there is one); None: none named, or not one transformers has."""
    config = Path(path) / "tokenizer_config.json"
    if not config.is_file():
        return None
    try:
        name = json.loads(config.read_text()).get("tokenizer_class")
    except (json.JSONDecodeError, AttributeError):
        return None
    if not isinstance(name, str) or not name.isidentifier():
        return None
    import transformers
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    for candidate in (name if name.endswith("Fast") else name + "Fast", name.removesuffix("Fast")):
        try:
            cls = getattr(transformers, candidate)
        except (AttributeError, ImportError):
            continue
        if isinstance(cls, type) and issubclass(cls, PreTrainedTokenizerBase):
            return cls
    return None
