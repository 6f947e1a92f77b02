"""Compiled grammars, made in a thread pool and kept by their text: the scheduler loop never
waits for a compile, and requests sharing a constraint share one compile. The cache is bounded
in entries and in bytes (one grammar measured 160 MB); the least recently used go first."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from batonlm.constrained.backend import GrammarBackend

MAX_CACHED_GRAMMARS = 256
MAX_CACHED_BYTES = 512 * 1024 * 1024


class GrammarCache:
    def __init__(self, make_backend: Callable[[], GrammarBackend], threads: int = 2) -> None:
        self._make_backend = make_backend  # built in the pool, at the first constraint
        self._backend: GrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar")
        self._futures: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self.compiles = 0  # compiles started (a shared constraint counts once)

    @property
    def backend(self) -> GrammarBackend:
        with self._backend_lock:
            if self._backend is None:
                self._backend = self._make_backend()
            return self._backend

    def get(self, kind: str, text: str) -> Future:
        """The compiled grammar of (kind, text), as a future (done at once when cached)."""
        key = (kind, text)
        fut = self._futures.get(key)
        if fut is not None:
            self._futures.move_to_end(key)
            return fut
        self.compiles += 1
        fut = self._pool.submit(self._compile, kind, text)
        self._futures[key] = fut
        self._evict()
        return fut

    def cancel(self, fut: Future) -> None:
        """Drop a compile nobody waits for, if it has not started."""
        if fut.cancel():
            for key, f in list(self._futures.items()):
                if f is fut:
                    del self._futures[key]

    def _evict(self) -> None:
        while len(self._futures) > MAX_CACHED_GRAMMARS:
            self._futures.popitem(last=False)
        sizes = {k: self.backend.size_bytes(f.result()) for k, f in self._futures.items()
                 if f.done() and not f.cancelled() and f.exception() is None}
        total = sum(sizes.values())
        for key in list(sizes):  # oldest first
            if total <= MAX_CACHED_BYTES:
                break
            total -= sizes[key]
            del self._futures[key]

    def _compile(self, kind: str, text: str) -> Any:
        return self.backend.compile(kind, text)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
