"""Lazy registries: a name -> "module:attribute" table, imported only when the entry is used.

Listing the names (for CLI choices and config checks) imports nothing, so the registry of
attention backends can be read by the CLI without torch, and no module imports another only
to make it register itself.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class UnknownEntry(ValueError):
    """A name that is not in a registry; the message lists the known ones."""


class LazyRegistry(Mapping[str, T], Generic[T]):
    def __init__(self, kind: str, entries: Mapping[str, str]) -> None:
        self.kind = kind
        self._targets = dict(entries)
        self._loaded: dict[str, T] = {}

    def names(self) -> tuple[str, ...]:
        return tuple(self._targets)

    def __contains__(self, name: object) -> bool:
        return name in self._targets

    def __iter__(self) -> Iterator[str]:
        return iter(self._targets)

    def __len__(self) -> int:
        return len(self._targets)

    def __getitem__(self, name: str) -> T:
        try:
            return self._loaded[name]
        except KeyError:
            pass
        try:
            target = self._targets[name]
        except KeyError:
            raise UnknownEntry(f"{self.kind} {name!r} is not supported (supported: {', '.join(self._targets)})") from None
        module, _, attr = target.partition(":")
        value: Any = getattr(importlib.import_module(module), attr)
        self._loaded[name] = value
        return value

    def target(self, name: str) -> str:
        """The "module:attribute" an entry points at (without importing it)."""
        return self._targets[name]
