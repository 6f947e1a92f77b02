"""Grammar compiles are bounded (issue 23: 6): a compile timeout, abandoned compiles cancelled,
the compiled-grammar cache bounded in bytes. A fake backend whose compiles block until told."""

from __future__ import annotations

import threading
import time

from batonlm.constrained.backend import GrammarBackend
from batonlm.constrained.grammar_cache import MAX_CACHED_BYTES
from batonlm.sampling_params import SamplingParams
from batonlm.scheduler.grammar_queue import GrammarQueue
from batonlm.scheduler.request import Request


class BlockingBackend(GrammarBackend):
    """Compiles wait for `release`; each compiled grammar 'holds' `size` bytes."""

    def __init__(self, size: int = 0) -> None:
        self.release = threading.Event()
        self.started: list[str] = []
        self.size = size

    def compile(self, kind, text):
        self.started.append(text)
        self.release.wait(30)
        return text

    def matcher(self, compiled):
        raise AssertionError("not needed")

    def allocate_bitmask(self, rows):
        raise AssertionError("not needed")

    def size_bytes(self, compiled):
        return self.size


def _req(rid: str, regex: str) -> Request:
    return Request(rid, [1, 2], SamplingParams(regex=regex), 0, 512, (2,))


def test_a_compile_that_takes_too_long_fails_its_request():
    backend = BlockingBackend()
    queue = GrammarQueue(lambda: backend, threads=1, compile_timeout_s=0.0)
    queue.add(req := _req("a", "x+"))
    time.sleep(0.001)
    ready, failed = queue.poll()  # the compile blocks: past a zero timeout
    assert ready == [] and [(r.rid, "--grammar-compile-timeout" in why) for r, why in failed] == [("a", True)]
    assert len(queue) == 0 and req.grammar is None
    backend.release.set()
    queue.close()


def test_an_abandoned_compile_that_has_not_started_is_cancelled():
    backend = BlockingBackend()
    queue = GrammarQueue(lambda: backend, threads=1)
    queue.add(first := _req("a", "x+"))
    queue.add(second := _req("b", "y+"))  # waits behind the first in the one thread
    queue.add(shared := _req("c", "x+"))  # shares the first's compile
    waiting = second.grammar
    assert queue.remove(second) and waiting is not None and waiting.cancelled()
    assert ("regex", "y+") not in queue.cache._futures
    assert queue.remove(first) and not shared.grammar.cancelled()  # another request still waits for it
    backend.release.set()
    shared.grammar.result(30)
    assert backend.started == ["x+"]  # "y+" never compiled
    queue.close()


def test_the_grammar_cache_is_bounded_in_bytes():
    backend = BlockingBackend(size=MAX_CACHED_BYTES // 2 + 1)  # two do not fit together
    backend.release.set()
    queue = GrammarQueue(lambda: backend, threads=1)
    queue.cache.get("regex", "a").result(30)
    queue.cache.get("regex", "b").result(30)
    queue.cache.get("regex", "c")  # a new entry: the cache is trimmed to its byte bound
    assert list(queue.cache._futures) == [("regex", "b"), ("regex", "c")]
    queue.close()
