"""Requests with a constraint: where they wait while their grammar compiles, and what the loop
does with their matchers (masks for a batch's delayed sampling, tokens accepted as results come).

Compiles run in the GrammarCache's threads; `poll` moves a request on once its grammar is ready
(the loop never waits for a compile). A batch with a constrained row samples late: in the
overlap loop after the previous batch's tokens have advanced the matchers, in the normal loop
right after its forward — the same path (`Scheduler.launch_delayed_sampling`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from batonlm.constrained.backend import GrammarBackend
from batonlm.constrained.grammar import backend_message
from batonlm.constrained.grammar_cache import GrammarCache
from batonlm.scheduler.batch import ScheduleBatch
from batonlm.scheduler.request import FINISH_STOP, Request

logger = logging.getLogger(__name__)


def grammar_backend(tokenizer_path: str | None, vocab_size: int, eos_ids: tuple[int, ...], whitespace: str):
    """The backend the cache compiles with (built at the first constraint, in its thread)."""
    from batonlm.constrained.xgrammar_backend import XGrammarBackend

    if tokenizer_path is None:
        raise ValueError("constraints need the tokenizer (SchedulerConfig.tokenizer_path)")
    return XGrammarBackend(tokenizer_path, vocab_size, list(eos_ids), whitespace)


class GrammarQueue:
    def __init__(self, make_backend: Callable[[], GrammarBackend], threads: int = 2,
                 compile_timeout_s: float = 60.0) -> None:
        self.cache = GrammarCache(make_backend, threads)
        self.pending: deque[Request] = deque()
        self.masked_batches = 0  # batches sampled through grammar masks
        self.compile_timeout_s = compile_timeout_s
        self._since: dict[str, float] = {}  # rid -> when its compile was asked for

    def __len__(self) -> int:
        return len(self.pending)

    def add(self, req: Request) -> None:
        assert req.params.constraint is not None  # only constrained requests come here
        kind, text = req.params.constraint
        req.grammar = self.cache.get(kind, text)
        self._since[req.rid] = time.monotonic()
        self.pending.append(req)

    def remove(self, req: Request) -> bool:
        """Take an aborted request out; its compile is cancelled when no other request waits
        for it and it has not started (one that runs cannot be stopped: its result is kept)."""
        if req not in self.pending:
            return False
        self.pending.remove(req)
        self._since.pop(req.rid, None)
        if req.grammar is not None and not any(r.grammar is req.grammar for r in self.pending):
            self.cache.cancel(req.grammar)
        req.grammar = None
        return True

    def poll(self) -> tuple[list[Request], list[tuple[Request, str]]]:
        """Requests whose grammar is ready (with their matcher), and those whose compile failed."""
        ready: list[Request] = []
        failed: list[tuple[Request, str]] = []
        waiting: deque[Request] = deque()
        for req in self.pending:
            future, constraint = req.grammar, req.params.constraint
            assert future is not None and constraint is not None  # set by add(), cleared only here
            if not future.done():
                if time.monotonic() - self._since[req.rid] > self.compile_timeout_s:
                    failed.append((req, f"the {constraint[0]} did not compile within --grammar-compile-timeout "
                                        f"({self.compile_timeout_s:g} s): simplify it"))
                    self._since.pop(req.rid)
                    req.grammar = None
                    continue
                waiting.append(req)
                continue
            self._since.pop(req.rid, None)
            req.grammar = None
            error = future.exception()
            if error is not None:
                failed.append((req, f"the {constraint[0]} could not be compiled: {backend_message(error)}"))
            else:
                matcher = self.cache.backend.matcher(future.result())
                if self._admits_nothing(matcher):  # an empty language: every token would be masked
                    failed.append((req, f"the {constraint[0]} admits no text: nothing could be generated"))
                    continue
                req.matcher = matcher
                ready.append(req)
        self.pending = waiting
        return ready, failed

    def _admits_nothing(self, matcher) -> bool:
        """No first token is allowed (`[^\\s\\S]`, `root ::= root`): sampling from an all-masked
        row drew token 0 for ever, one error line per token."""
        if matcher.terminated:
            return False
        bitmask = self.cache.backend.allocate_bitmask(1)
        matcher.fill_mask(bitmask, 0)
        return not bool(bitmask.any())

    @staticmethod
    def needs_masks(batch: ScheduleBatch) -> bool:
        return any(r.matcher is not None for r in batch.reqs)

    def masks(self, batch: ScheduleBatch) -> dict:
        """SampleLaunch fields masking each constrained row that will produce a token now.
        Rows that will not (a request finished, retracted, or whose grammar is complete: their
        token is dropped) are left alone rather than given an empty mask. A verifying request's
        rows (its newest output, then its drafts) get the masks of the states after the drafts
        before them (accepted, filled, rolled back); past a draft the grammar rejects, or that
        completes it, rows keep the last mask: no draft after it can be accepted."""
        rows = [
            row for row, (req, epoch, produces) in enumerate(zip(batch.reqs, batch.epochs, batch.produces_output))
            if req.matcher is not None and produces and not req.finished and epoch == req.epoch
            and not req.matcher.terminated
        ]
        if not rows:
            return {}
        self.masked_batches += 1
        drafts = [batch.drafts[row - len(batch.extend)] if batch.drafts and row >= len(batch.extend) else []
                  for row in rows]
        bitmask = self.cache.backend.allocate_bitmask(sum(1 + len(d) for d in drafts))
        mask_rows: list[int] = []
        i = 0
        for row, row_drafts in zip(rows, drafts):
            matcher, at = batch.reqs[row].matcher, batch.launch_rows[row]
            assert matcher is not None  # rows are those with a matcher
            matcher.fill_mask(bitmask, i)
            taken = 0  # drafts the matcher accepted, all of them so far
            for j, tok in enumerate(row_drafts, 1):
                if taken == j - 1 and not matcher.terminated and matcher.accept(tok):
                    taken += 1
                if taken == j and not matcher.terminated:
                    matcher.fill_mask(bitmask, i + j)
                else:
                    bitmask[i + j] = bitmask[i + j - 1]
            if taken:
                matcher.rollback(taken)
            mask_rows.extend(range(at, at + 1 + len(row_drafts)))
            i += 1 + len(row_drafts)
        return {"mask_rows": mask_rows, "mask_words": bitmask.shape[1], "bitmask": bitmask.numpy().tobytes()}

    @staticmethod
    def advance(req: Request, token: int) -> bool:
        """Follow a token the request produced (False: it does not fit the grammar); a completed
        grammar finishes the request."""
        matcher = req.matcher
        assert matcher is not None  # the caller follows only constrained requests
        if not matcher.accept(token):
            logger.info("request %s: token %d does not fit its grammar (a dead end)", req.rid, token)
            return False
        if matcher.terminated and not req.finished:
            req.finish_reason = FINISH_STOP
        return True

    def close(self) -> None:
        self.cache.close()
