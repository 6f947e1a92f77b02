"""The grammar backend interface: compile a constraint once for the vocabulary, then one
matcher per request that follows its tokens and fills its mask of allowed next tokens."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch


class GrammarMatcher(ABC):
    @abstractmethod
    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it."""

    @abstractmethod
    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row `row` of an int32 bitmask [R, ceil(V / 32)]."""

    @property
    @abstractmethod
    def terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted."""

    @abstractmethod
    def rollback(self, n: int) -> None:
        """Undo the last n accepted tokens (masks for speculative drafts are filled ahead)."""


class GrammarBackend(ABC):
    @abstractmethod
    def compile(self, kind: str, text: str) -> Any:
        """The compiled grammar (slow: the caller runs this in a thread pool)."""

    @abstractmethod
    def matcher(self, compiled: Any) -> GrammarMatcher: ...

    def size_bytes(self, compiled: Any) -> int:
        """What a compiled grammar holds in memory (the cache's bound)."""
        return 0

    @abstractmethod
    def allocate_bitmask(self, rows: int) -> torch.Tensor: ...
