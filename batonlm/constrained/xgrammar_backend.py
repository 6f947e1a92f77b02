"""The xgrammar grammar backend (https://github.com/mlc-ai/xgrammar)."""

from __future__ import annotations

from typing import Any

import torch

from batonlm.constrained.backend import GrammarBackend, GrammarMatcher
from batonlm.constrained.grammar import BOUNDED_WHITESPACE


class XGrammarMatcher(GrammarMatcher):
    def __init__(self, matcher: Any) -> None:
        self._m = matcher

    def accept(self, token: int) -> bool:
        return bool(self._m.accept_token(token))

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    @property
    def terminated(self) -> bool:
        return bool(self._m.is_terminated())

    def rollback(self, n: int) -> None:
        self._m.rollback(n)


class XGrammarBackend(GrammarBackend):
    """Built from the model's tokenizer with the model's vocabulary size (which may exceed the
    tokenizer's) and its stop tokens; special tokens other than those are never allowed."""

    def __init__(self, tokenizer_path: str, vocab_size: int, stop_token_ids: list[int], whitespace: str,
                 threads: int = 2) -> None:
        import xgrammar as xgr
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self._xgr = xgr
        self.vocab_size = vocab_size
        # No cache of its own (unbounded by default: it grew the scheduler by 1.1 GB and kept it):
        # GrammarCache keeps the compiled grammars, bounded.
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self.whitespace = whitespace

    def compile(self, kind: str, text: str) -> Any:
        if kind == "json_schema":
            any_ws = self.whitespace != "compact"
            max_ws = BOUNDED_WHITESPACE if self.whitespace == "bounded" else None
            return self.compiler.compile_json_schema(text, any_whitespace=any_ws, max_whitespace_cnt=max_ws)
        if kind == "regex":
            return self.compiler.compile_regex(text)
        if kind == "ebnf":
            return self.compiler.compile_grammar(text)
        raise ValueError(f"unknown constraint kind {kind!r}")

    def size_bytes(self, compiled: Any) -> int:
        return int(compiled.memory_size_bytes)

    def matcher(self, compiled: Any) -> GrammarMatcher:
        return XGrammarMatcher(self._xgr.GrammarMatcher(compiled))

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        return self._xgr.allocate_token_bitmask(rows, self.vocab_size)
