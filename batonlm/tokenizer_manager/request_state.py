"""One request as the frontend tracks it: its queue of scheduler outputs, its text state
(incremental detokenization, stop strings), and what its consumer is handed (GenerationChunk)."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from batonlm.ipc.messages import TokenOutput, merge_outputs
from batonlm.tokenizer_manager.detokenizer import IncrementalDetokenizer
from batonlm.tokenizer_manager.stop_strings import StopStringMatcher

FINISH_STOP, FINISH_ABORT = "stop", "abort"


class SchedulerGone(RuntimeError):
    """The scheduler process died, or the server is shutting down: no request can be served."""


class QueueFull(RuntimeError):
    """More requests are waiting than `max_queued_requests` allows; try again later."""

    retry_after_s = 1


class RequestTimedOut(RuntimeError):
    """A request ran longer than `request_timeout` and was aborted."""


class ClientTooSlow(RuntimeError):
    """A stream's client fell more than `max_stream_backlog` outputs behind; it was aborted."""


# A token the constraints or the temperature rule out has logprob -inf, which JSON cannot carry
# (json.dumps refuses it, orjson writes null against OpenAI's schema): answers floor it here,
# where every route's logprobs come from, at OpenAI's and vLLM's -9999.0.
LOGPROB_FLOOR = -9999.0


def _floor(lp: float) -> float:
    return lp if lp >= LOGPROB_FLOOR else LOGPROB_FLOOR  # a NaN (never expected) becomes the floor too


def _floor_top(top) -> list[tuple[int, float]]:
    return [(t, _floor(lp)) for t, lp in top]


@dataclass
class TokenLogprob:
    """A token's logprob and its top alternatives (id, logprob); the first prompt token has
    neither (None): nothing precedes it."""

    token_id: int
    logprob: float | None
    top: list[tuple[int, float]] | None


@dataclass
class GenerationChunk:
    """What one iteration added to a request."""

    rid: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None
    cached_tokens: int | None = None  # with the first token: prompt tokens the prefix cache served
    # With the first token, when asked: the prompt's logprobs from logprob_start_len on (None
    # for position 0) and their top alternatives (TokenOutput's).
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    spec: tuple[int, int] | None = None  # with the last chunk: (verification steps, drafts accepted)
    stop_string: str | None = None  # with the last chunk: the stop string that ended the text, if one did
    preemptions: int = 0  # with the last chunk: retractions for requests of higher priority
    embedding: list[float] | None = None  # an embedding request's pooled hidden states (TokenOutput's)
    error_about: str | None = None  # TokenOutput's: which part of the request `error` is about


class RequestObserver(Protocol):
    """Timing hooks (the server's Prometheus metrics implement them)."""

    def on_first_token(self, ttft_s: float, queued_s: float | None) -> None: ...

    def on_token(self, itl_s: float) -> None: ...

    def on_finish(self, e2e_s: float, prompt_tokens: int, completion_tokens: int, finish_reason: str) -> None: ...


@dataclass
class RequestState:
    rid: str
    detok: IncrementalDetokenizer
    stops: StopStringMatcher
    prompt_tokens: int
    min_tokens: int = 0  # stop strings end the request only after this many tokens
    generates: bool = True  # False: an embedding request (its one sampled token is not an output)
    # Scheduler outputs not yet consumed, or the exception that ends the request.
    pending: deque[TokenOutput | Exception] = field(default_factory=deque)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    completion_tokens: int = 0
    finished: bool = False
    created: float = field(default_factory=time.perf_counter)
    last_token: float | None = None
    timer: Any = None  # the request timeout's TimerHandle

    def put(self, item: TokenOutput | Exception) -> None:
        self.pending.append(item)
        self.ready.set()

    def fail(self, error: Exception) -> None:
        """End the request with `error`: what is still pending is dropped (a failed stream's
        consumer gets the error next, not a backlog first)."""
        self.pending.clear()
        self.put(error)

    async def next(self) -> TokenOutput:
        """The next output; several waiting (the consumer fell behind the scheduler's
        iterations) come as one: one chunk, one detokenization, one event for all of them."""
        while not self.pending:
            self.ready.clear()
            await self.ready.wait()
        item = self.pending.popleft()
        if isinstance(item, Exception):
            raise item
        if not self.pending or isinstance(self.pending[0], Exception):
            return item
        outs = [item]
        while self.pending and not isinstance(self.pending[0], Exception):
            outs.append(self.pending.popleft())  # type: ignore[arg-type]  # not an Exception: checked
        return merge_outputs(outs)

    def apply(self, out: TokenOutput, observer: RequestObserver | None) -> tuple[GenerationChunk, bool]:
        """Turn one output into the consumer's chunk; also says whether a stop string ended the
        request before the scheduler did (it must then be told to stop)."""
        now = time.perf_counter()
        if out.token_ids:
            if observer is not None:  # one gap per token after the first: tokens that came together share theirs
                gaps = len(out.token_ids)
                if self.last_token is None:
                    observer.on_first_token(now - self.created, out.queued_s)
                    gaps, gap = gaps - 1, 0.0
                else:
                    gap = (now - self.last_token) / gaps
                for _ in range(gaps):
                    observer.on_token(gap)
            self.last_token = now
        self.completion_tokens += len(out.token_ids)
        armed = self.completion_tokens >= self.min_tokens  # stop strings count from the min_tokens-th token on
        finish = out.finish_reason
        text = self.stops.feed(self.detok.add(out.token_ids), armed, self.completion_tokens)
        stopped_early = False
        if self.stops.stopped:
            # A stop string wins over a length limit reached by the same token (as in vLLM).
            stopped_early = finish is None
            finish = FINISH_STOP
        if finish is not None:
            self.finished = True
            if not self.stops.stopped:
                text += self.stops.feed(self.detok.flush(), True, self.completion_tokens) + self.stops.flush()
            if observer is not None:  # an embedding counts no generated token and ends normally
                observer.on_finish(now - self.created, self.prompt_tokens,
                                   self.completion_tokens if self.generates else 0, finish if self.generates else "stop")
        logprobs = None
        if out.logprobs is not None:
            top = out.top_logprobs or [[] for _ in out.logprobs]
            logprobs = [TokenLogprob(t, _floor(lp), _floor_top(tl)) for t, lp, tl in zip(out.token_ids, out.logprobs, top)]
        chunk = GenerationChunk(
            rid=self.rid,
            text=text,
            token_ids=list(out.token_ids),
            finish_reason=finish,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            error=out.error,
            error_about=out.error_about,
            logprobs=logprobs,
            cached_tokens=out.cached_tokens,
            prompt_logprobs=None if out.prompt_logprobs is None else [
                None if lp is None else _floor(lp) for lp in out.prompt_logprobs],
            prompt_top_logprobs=None if out.prompt_top_logprobs is None else [
                _floor_top(tl) for tl in out.prompt_top_logprobs],
            spec=out.spec,
            stop_string=self.stops.matched if finish is not None else None,
            preemptions=out.preemptions,
            embedding=out.embedding,
        )
        return chunk, stopped_early
