"""TokenizerManager: the frontend's side of the scheduler, on one asyncio loop.

Turns requests into `GenerateRequest`s, sends them to the scheduler, and turns the token ids
that come back into text deltas per request. Owns the map request id -> waiting consumer; a
consumer that goes away aborts its request.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import zmq
import zmq.asyncio

from batonlm.config import ServerArgs
from batonlm.ipc import codec
from batonlm.ipc.codec import Message
from batonlm.ipc.endpoints import new_endpoints
from batonlm.ipc.messages import (
    AbortRequest,
    BatchOutput,
    GenerateRequest,
    SchedulerFailed,
    SchedulerInfo,
    SchedulerStats,
    ShutdownRequest,
    StatsRequest,
    TokenOutput,
)
from batonlm.request_checks import check_request
from batonlm.sampling_params import SamplingParams
from batonlm.tokenizer_manager.detokenizer import IncrementalDetokenizer
from batonlm.tokenizer_manager.stop_strings import StopStringMatcher

logger = logging.getLogger(__name__)


class SchedulerGone(RuntimeError):
    """The scheduler process died; no request can be served any more."""


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


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


class SchedulerProcess(Protocol):
    """The running scheduler, as the launcher hands it over."""

    process: Any  # a multiprocessing.Process
    info: SchedulerInfo

    def stop(self, timeout_s: float = 10.0) -> None: ...


# Starts the scheduler process given (args, ipc dir, request endpoint, output endpoint); the
# entry points pass batonlm.launcher.start_scheduler, so this package never imports the scheduler.
LaunchScheduler = Callable[[ServerArgs, str, str, str], SchedulerProcess]


class RequestObserver(Protocol):
    """Timing hooks (the server's Prometheus metrics implement them)."""

    def on_first_token(self, ttft_s: float) -> None: ...

    def on_token(self, itl_s: float) -> None: ...

    def on_finish(self, e2e_s: float, prompt_tokens: int, completion_tokens: int) -> None: ...


@dataclass
class _ReqState:
    detok: IncrementalDetokenizer
    stops: StopStringMatcher
    prompt_tokens: int
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    completion_tokens: int = 0
    finished: bool = False
    created: float = field(default_factory=time.perf_counter)
    last_token: float | None = None


class TokenizerManager:
    def __init__(self, args: ServerArgs, tokenizer: Any, launch: LaunchScheduler) -> None:
        self.args = args
        self.tokenizer = tokenizer
        self._launch = launch
        self.info: SchedulerInfo | None = None
        self.handle: SchedulerProcess | None = None
        self.states: dict[str, _ReqState] = {}
        self.healthy = False
        self.on_scheduler_death: Callable[[], None] | None = None
        self.observer: RequestObserver | None = None
        self._stats_waiters: list[asyncio.Future] = []
        self._ctx = zmq.asyncio.Context(1)
        self._push: zmq.asyncio.Socket | None = None
        self._pull: zmq.asyncio.Socket | None = None
        self._output_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> SchedulerInfo:
        """Bind the sockets, spawn the scheduler, and wait until it has loaded the model."""
        self._loop = asyncio.get_running_loop()
        ipc_dir, req_ep, out_ep = new_endpoints()
        try:
            self._push = self._ctx.socket(zmq.PUSH)
            self._push.setsockopt(zmq.LINGER, 0)
            self._push.bind(req_ep)
            self._pull = self._ctx.socket(zmq.PULL)
            self._pull.bind(out_ep)
            self.handle = await asyncio.to_thread(self._launch, self.args, ipc_dir, req_ep, out_ep)
        except BaseException:
            self._close_sockets()
            shutil.rmtree(ipc_dir, ignore_errors=True)
            raise
        self.info = self.handle.info
        self.healthy = True
        self._output_task = asyncio.create_task(self._output_loop())
        self._loop.add_reader(self.handle.process.sentinel, self._scheduler_exited)
        return self.info

    async def shutdown(self) -> None:
        if self.handle is None:
            return
        handle, self.handle = self.handle, None
        self._loop.remove_reader(handle.process.sentinel)  # type: ignore[union-attr]
        if handle.process.is_alive():
            await self._send(ShutdownRequest())
        await asyncio.to_thread(handle.stop)
        self.healthy = False
        self._fail_all(SchedulerGone("the server is shutting down"))
        if self._output_task is not None:
            self._output_task.cancel()
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._push, self._pull):
            if sock is not None:
                sock.close(0)
        self._ctx.term()

    def _scheduler_exited(self) -> None:
        assert self.handle is not None and self._loop is not None
        self._loop.remove_reader(self.handle.process.sentinel)
        self.handle.process.join(1.0)  # reap it, for the exit code
        code = self.handle.process.exitcode
        logger.error("the scheduler process exited unexpectedly (exit code %s)", code)
        self.healthy = False
        self._fail_all(SchedulerGone(f"the scheduler process died (exit code {code})"))
        if self.on_scheduler_death is not None:
            self.on_scheduler_death()

    def _fail_all(self, error: Exception) -> None:
        for state in self.states.values():
            state.queue.put_nowait(error)
        for fut in self._stats_waiters:
            if not fut.done():
                fut.set_exception(error)
        self._stats_waiters.clear()

    # ------------------------------------------------------------------ IO
    async def _send(self, msg: Message) -> None:
        if not self.healthy:
            raise SchedulerGone("the scheduler is not running")
        await self._push.send(codec.encode(msg))  # type: ignore[union-attr]

    async def _output_loop(self) -> None:
        while True:
            msg = codec.decode(await self._pull.recv())  # type: ignore[union-attr]
            if isinstance(msg, BatchOutput):
                for out in msg.outputs:
                    state = self.states.get(out.rid)
                    if state is not None:
                        state.queue.put_nowait(out)
            elif isinstance(msg, SchedulerStats):
                if self._stats_waiters:
                    fut = self._stats_waiters.pop(0)
                    if not fut.done():
                        fut.set_result(msg)
            elif isinstance(msg, SchedulerFailed):
                logger.error("scheduler failed: %s", msg.message)
                self.healthy = False
                self._fail_all(SchedulerGone(f"the scheduler failed: {msg.message}"))

    # ------------------------------------------------------------------ requests
    def tokenize(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt).input_ids)

    def validate_prompt(self, input_ids: list[int], params: SamplingParams, prompt_param: str | None = None) -> None:
        """Reject what the scheduler would reject, with the numbers, before sending anything
        (RequestRejected naming `prompt_param`, or InvalidSamplingParams)."""
        info = self.info
        if info is None:
            raise SchedulerGone("the scheduler has not started")
        check_request(
            input_ids, params, context_length=info.context_length, vocab_size=info.vocab_size,
            kv_capacity=info.kv_capacity, prompt_param=prompt_param,
        )

    async def generate(
        self,
        input_ids: list[int],
        params: SamplingParams,
        rid: str | None = None,
        stop: list[str] | None = None,
    ) -> AsyncIterator[GenerationChunk]:
        """Stream one request's chunks. A stop string ends it with "stop" (the string and what
        follows are trimmed). Leaving the iteration early aborts the request.

        `rid` is only a label: the scheduler sees a fresh id, so a client reusing an id can never
        receive the late outputs of an earlier request that had that id."""
        rid = f"{rid or 'req'}-{uuid.uuid4().hex}"
        state = _ReqState(IncrementalDetokenizer(self.tokenizer, input_ids), StopStringMatcher(stop or []), len(input_ids))
        self.states[rid] = state
        try:
            await self._send(GenerateRequest(rid, input_ids, params))
            while not state.finished:
                item = await state.queue.get()
                if isinstance(item, Exception):
                    raise item
                yield self._apply(rid, state, item)
        finally:
            self.states.pop(rid, None)
            if not state.finished and self.healthy:
                # No await: this also runs when the consumer's task is being cancelled.
                self.abort_nowait(rid)

    def _apply(self, rid: str, state: _ReqState, out: TokenOutput) -> GenerationChunk:
        now = time.perf_counter()
        if out.token_ids and self.observer is not None:
            if state.last_token is None:
                self.observer.on_first_token(now - state.created)
            else:
                self.observer.on_token(now - state.last_token)
        if out.token_ids:
            state.last_token = now
        state.completion_tokens += len(out.token_ids)
        finish = out.finish_reason
        text = state.stops.feed(state.detok.add(out.token_ids))
        if state.stops.stopped:
            # A stop string wins over a length limit reached by the same token (as in vLLM).
            if finish is None:
                self.abort_nowait(rid)  # stop the scheduler's work on it
            finish = "stop"
        if finish is not None:
            state.finished = True
            if not state.stops.stopped:
                text += state.stops.feed(state.detok.flush()) + state.stops.flush()
            if self.observer is not None:
                self.observer.on_finish(now - state.created, state.prompt_tokens, state.completion_tokens)
        logprobs = None
        if out.logprobs is not None:
            top = out.top_logprobs or [[] for _ in out.logprobs]
            logprobs = [TokenLogprob(t, lp, list(tl)) for t, lp, tl in zip(out.token_ids, out.logprobs, top)]
        return GenerationChunk(
            rid=rid,
            text=text,
            token_ids=list(out.token_ids),
            finish_reason=finish,
            prompt_tokens=state.prompt_tokens,
            completion_tokens=state.completion_tokens,
            error=out.error,
            logprobs=logprobs,
        )

    def abort_nowait(self, rid: str) -> None:
        """Tell the scheduler to drop a request, without awaiting (safe in cancelled tasks)."""
        if not self.healthy or self._push is None:
            return
        sent = self._push.send(codec.encode(AbortRequest(rid)), flags=zmq.NOBLOCK)

        def check(fut) -> None:
            if fut.cancelled() or fut.exception() is not None:
                logger.warning("the abort of request %s was not sent: %s", rid, fut.exception())

        sent.add_done_callback(check)

    async def get_stats(self, timeout_s: float = 10.0) -> SchedulerStats:
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._stats_waiters.append(fut)
        await self._send(StatsRequest())
        return await asyncio.wait_for(fut, timeout_s)
