"""TokenizerManager: the frontend's side of the scheduler, on one asyncio loop.

Turns requests into `GenerateRequest`s, sends them to the scheduler, and turns the token ids
that come back into text deltas per request. Owns the map request id -> waiting consumer; a
consumer that goes away aborts its request. It also keeps the server's request-level limits:
admission (`max_queued_requests`), `request_timeout`, `max_stream_backlog`, and the drain on
shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import threading
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import zmq
import zmq.asyncio

from batonlm.config import ServerArgs
from batonlm.constrained.grammar import InvalidConstraint, check_constraint
from batonlm.ipc import codec
from batonlm.ipc.codec import Message
from batonlm.ipc.endpoints import new_endpoints
from batonlm.ipc.messages import (
    AbortRequest,
    BatchOutput,
    FlushCacheRequest,
    FlushCacheResult,
    GenerateRequest,
    SchedulerFailed,
    SchedulerInfo,
    SchedulerStats,
    ShutdownRequest,
    StatsRequest,
)
from batonlm.request_checks import RequestRejected, check_request
from batonlm.sampling_params import InvalidSamplingParams, SamplingParams
from batonlm.tokenizer_manager.detokenizer import IncrementalDetokenizer
from batonlm.tokenizer_manager.dp_router import DPRouter
from batonlm.tokenizer_manager.request_state import (
    FINISH_ABORT,
    ClientTooSlow,
    GenerationChunk,
    QueueFull,
    RequestObserver,
    RequestState,
    RequestTimedOut,
    SchedulerGone,
)
from batonlm.tokenizer_manager.stop_strings import StopStringMatcher

logger = logging.getLogger(__name__)

# Texts longer than this are tokenized in a thread: the tokenizers library releases the GIL,
# so a megabyte of prompt does not stall every other request's stream.
TOKENIZE_INLINE_CHARS = 8192
SHUTDOWN_SEND_TIMEOUT_S = 2.0


class SchedulerProcess(Protocol):
    """The running scheduler, as the launcher hands it over."""

    process: Any  # a multiprocessing.Process
    info: SchedulerInfo

    def stop(self, timeout_s: float = 10.0) -> None: ...


# Starts a scheduler process given (args, ipc dir, request endpoint, output endpoint, data-parallel
# rank, an event that cancels the start: the process is killed and the call raises); the entry
# points pass batonlm.launcher.start_scheduler, so this package never imports the scheduler.
LaunchScheduler = Callable[[ServerArgs, str, str, str, int, threading.Event], SchedulerProcess]


class Admission:
    """Room `TokenizerManager.admit` took for a request's choices: each `generate` given it takes
    one; `release` gives back what was not taken (the request failed before sending them, or
    was never streamed). Releasing twice is harmless."""

    def __init__(self, manager: TokenizerManager, count: int) -> None:
        self._manager, self.left = manager, count

    def take(self) -> None:
        if self.left:
            self.left -= 1
            self._manager._reserved -= 1

    def release(self) -> None:
        self._manager._reserved -= self.left
        self.left = 0


class TokenizerManager:
    def __init__(self, args: ServerArgs, tokenizer: Any, launch: LaunchScheduler) -> None:
        self.args = args
        self.tokenizer = tokenizer
        self._launch = launch
        self.info: SchedulerInfo | None = None
        # One scheduler per data-parallel replica (one without --dp), each with its own request
        # socket; their outputs share one socket. `router` picks a request's replica.
        self.handles: list[SchedulerProcess] = []
        self.router = DPRouter(args.dp_size, args.load_balance_method)
        self._owner: dict[str, int] = {}  # request id -> its replica
        self.states: dict[str, RequestState] = {}
        self._reserved = 0  # requests admitted and not sent yet (Admission)
        self.healthy = False
        self.draining = False
        self.on_scheduler_death: Callable[[], None] | None = None
        self.observer: RequestObserver | None = None
        # Per replica: futures waiting for its SchedulerStats / FlushCacheResult, in order.
        self._stats_waiters: list[list[asyncio.Future]] = [[] for _ in range(args.dp_size)]
        self._flush_waiters: list[list[asyncio.Future]] = [[] for _ in range(args.dp_size)]
        self._ctx = zmq.asyncio.Context(1)
        self._pushes: list[zmq.asyncio.Socket] = []
        self._pull: zmq.asyncio.Socket | None = None
        self._output_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def handle(self) -> SchedulerProcess | None:
        """The (first replica's) scheduler."""
        return self.handles[0] if self.handles else None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> SchedulerInfo:
        """Bind the sockets, spawn the scheduler(s), and wait until they have loaded the model."""
        self._loop = asyncio.get_running_loop()
        ipc_dir, _, out_ep = new_endpoints()
        req_eps = [f"ipc://{ipc_dir}/requests-{i}" for i in range(self.args.dp_size)]
        try:
            for ep in req_eps:
                push = self._ctx.socket(zmq.PUSH)
                push.setsockopt(zmq.LINGER, 0)
                push.bind(ep)
                self._pushes.append(push)
            self._pull = self._ctx.socket(zmq.PULL)
            self._pull.bind(out_ep)
            # A thread per replica: DP attention's replicas meet while they start, so all of them
            # must start at once (the default pool may have fewer threads than replicas). A
            # cancelled start (Ctrl-C, SIGTERM) tells the threads, which kill their scheduler
            # and return at once; one that had started already is stopped here.
            cancel = threading.Event()
            ready: list[SchedulerProcess] = []

            def launch(i: int, ep: str) -> SchedulerProcess:
                handle = self._launch(self.args, ipc_dir, ep, out_ep, i, cancel)
                ready.append(handle)
                return handle

            pool = ThreadPoolExecutor(len(req_eps), thread_name_prefix="batonlm-start")
            try:
                started = await asyncio.gather(
                    *(self._loop.run_in_executor(pool, launch, i, ep) for i, ep in enumerate(req_eps)),
                    return_exceptions=True,
                )
            except BaseException:
                cancel.set()
                pool.shutdown(wait=True)
                for handle in ready:
                    handle.process.kill()
                    handle.stop(5.0)
                raise
            pool.shutdown(wait=True)
            failed = [r for r in started if isinstance(r, BaseException)]
            self.handles = [r for r in started if not isinstance(r, BaseException)]
            if failed:
                for handle in self.handles:  # the replicas that did start go too
                    handle.process.kill()
                    await asyncio.to_thread(handle.stop)
                self.handles = []
                raise failed[0]
        except BaseException:
            self._close_sockets()
            shutil.rmtree(ipc_dir, ignore_errors=True)
            raise
        self.info = self.handles[0].info
        self.healthy = True
        self._output_task = asyncio.create_task(self._output_loop())
        for i, handle in enumerate(self.handles):
            self._loop.add_reader(handle.process.sentinel, self._scheduler_exited, i)
        return self.info

    async def shutdown(self) -> None:
        if not self.handles:
            return
        handles, self.handles = self.handles, []
        assert self._loop is not None  # start() set it before it made handles
        for handle in handles:  # before any await: a replica exiting now is no failure
            self._loop.remove_reader(handle.process.sentinel)

        async def tell(i: int, handle: SchedulerProcess) -> None:
            if handle.process.is_alive():
                # A scheduler that is exiting already (SIGTERM to the whole process group) has no
                # socket left: a PUSH send with no peer blocks for ever. stop() waits for it anyway.
                try:
                    await asyncio.wait_for(self._send(ShutdownRequest(), i), SHUTDOWN_SEND_TIMEOUT_S)
                except asyncio.TimeoutError:
                    logger.info("the scheduler did not take the shutdown request; waiting for it to exit")
            await asyncio.to_thread(handle.stop)

        await asyncio.gather(*(tell(i, h) for i, h in enumerate(handles)))
        self.healthy = False
        self._fail_all(SchedulerGone("the server is shutting down"))
        if self._output_task is not None:
            self._output_task.cancel()
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (*self._pushes, self._pull):
            if sock is not None:
                sock.close(0)
        self._ctx.term()

    def _scheduler_exited(self, replica: int) -> None:
        """A scheduler died: the server cannot serve (a replica's requests would hang)."""
        assert self._loop is not None
        handle = self.handles[replica]
        for h in self.handles:
            self._loop.remove_reader(h.process.sentinel)
        handle.process.join(1.0)  # reap it, for the exit code
        code = handle.process.exitcode
        which = "the scheduler process" if len(self.handles) == 1 else f"the scheduler of replica {replica}"
        logger.error("%s exited unexpectedly (exit code %s)", which, code)
        self.healthy = False
        self._fail_all(SchedulerGone(f"the scheduler process died (exit code {code})"))
        if self.on_scheduler_death is not None:
            self.on_scheduler_death()

    async def drain(self, timeout_s: float) -> None:
        """Refuse new requests, give those in flight up to `timeout_s` to finish, then end the
        rest with an error (their clients get it: a 503, or an error event on a stream)."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self.states and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.states:
            logger.warning("aborting %d request(s) still running after %.0f s of shutdown", len(self.states), timeout_s)
            self._fail_all(SchedulerGone("the server is shutting down"))

    def fail_all(self, message: str) -> None:
        """End every request in flight now with `message` (an error event, or a 503)."""
        self.draining = True
        self._fail_all(SchedulerGone(message))

    def _fail_all(self, error: Exception) -> None:
        for state in self.states.values():
            state.fail(error)
        for waiters in self._stats_waiters + self._flush_waiters:
            for fut in waiters:
                if not fut.done():
                    fut.set_exception(error)
            waiters.clear()

    # ------------------------------------------------------------------ IO
    async def _send(self, msg: Message, replica: int = 0) -> None:
        if not self.healthy:
            raise SchedulerGone("the scheduler is not running")
        await self._pushes[replica].send(codec.encode(msg))

    async def _output_loop(self) -> None:
        assert self._pull is not None  # start() opened it before starting this task
        while True:
            msg = codec.decode(await self._pull.recv())
            if isinstance(msg, BatchOutput):
                backlog = self.args.max_stream_backlog
                for out in msg.outputs:
                    state = self.states.get(out.rid)
                    if state is None:
                        continue
                    if len(state.pending) < backlog:
                        state.put(out)
                    elif not isinstance(state.pending[-1], Exception):
                        # Its client does not read: stop buffering its output and stop its work.
                        logger.info("request %s aborted: its client fell %d outputs behind", out.rid, backlog)
                        state.fail(ClientTooSlow(f"the client fell more than {backlog} outputs behind its stream"))
                        self.abort_nowait(out.rid)
            elif isinstance(msg, SchedulerStats | FlushCacheResult):
                waiters = (self._stats_waiters if isinstance(msg, SchedulerStats) else self._flush_waiters)[msg.dp_rank]
                if waiters:
                    fut = waiters.pop(0)
                    if not fut.done():
                        fut.set_result(msg)
            elif isinstance(msg, SchedulerFailed):
                # The details are for the log; clients learn that the server cannot serve them.
                logger.error("scheduler failed: %s", msg.message)
                self.healthy = False
                self._fail_all(SchedulerGone("the scheduler failed (the server log has the details)"))

    # ------------------------------------------------------------------ requests
    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids)

    async def tokenize_async(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        if len(prompt) <= TOKENIZE_INLINE_CHARS:
            return self.tokenize(prompt, add_special_tokens)
        return await asyncio.to_thread(self.tokenize, prompt, add_special_tokens)

    async def detokenize_async(self, token_ids: list[int]) -> str:
        if len(token_ids) <= TOKENIZE_INLINE_CHARS:
            return self.tokenizer.decode(token_ids)
        return await asyncio.to_thread(self.tokenizer.decode, token_ids)

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
        if params.constraint is not None:
            kind, text = params.constraint
            try:
                check_constraint(kind, text)  # cached: the OpenAI routes checked it already
            except InvalidConstraint as e:
                raise InvalidSamplingParams(kind, f"invalid {kind.replace('_', ' ')}: {e}") from None

    def admit(self, num_requests: int, param: str | None = None) -> Admission:
        """Room for `num_requests` more requests, taken now (at arrival, before tokenizing: two
        requests arriving together cannot both take the last room). QueueFull when every
        request sent and not finished, with those admitted and not sent yet, would exceed what
        may be in flight (the scheduler runs at most max_running_requests of them, the rest
        wait); RequestRejected naming `param` when this request alone never fits."""
        if self.draining:
            raise SchedulerGone("the server is shutting down")
        queued = self.args.max_queued_requests
        running = self.args.max_running_requests * self.args.dp_size  # per replica
        if queued is not None:
            if num_requests > running + queued:
                raise RequestRejected(
                    f"{num_requests} requests (prompts x n) can never be admitted: at most {running + queued} "
                    f"may be in flight ({running} running and {queued} queued)", param=param)
            in_flight = len(self.states) + self._reserved
            if in_flight + num_requests > running + queued:
                raise QueueFull(
                    f"the server is full ({in_flight} requests in flight, at most {running} running and "
                    f"{queued} queued); retry later"
                )
        self._reserved += num_requests
        return Admission(self, num_requests)

    async def generate(
        self,
        input_ids: list[int],
        params: SamplingParams,
        rid: str | None = None,
        stop: list[str] | None = None,
        admission: Admission | None = None,
    ) -> AsyncGenerator[GenerationChunk, None]:
        """Stream one request's chunks. A stop string ends it with "stop" (the string and what
        follows are trimmed). Leaving the iteration early aborts the request, as do the
        request timeout and a consumer that falls too far behind (those raise).

        `rid` is only a label: the scheduler sees a fresh id, so a client reusing an id can never
        receive the late outputs of an earlier request that had that id."""
        rid = f"{rid or 'req'}-{uuid.uuid4().hex}"
        state = RequestState(
            rid, IncrementalDetokenizer(self.tokenizer, input_ids), StopStringMatcher(stop or []), len(input_ids),
            min_tokens=params.min_new_tokens,
        )
        timeout = self.args.request_timeout
        if timeout is not None:
            error = RequestTimedOut(f"the request ran longer than the server's request timeout ({timeout:g} s)")
            state.timer = asyncio.get_running_loop().call_later(timeout, state.fail, error)
        self.states[rid] = state
        if admission is not None:
            admission.take()  # counted in `states` from now on
        replica = self._owner[rid] = self.router.choose(input_ids)
        try:
            await self._send(GenerateRequest(rid, input_ids, params), replica)
            while not state.finished:
                chunk, stopped_early = state.apply(await state.next(), self.observer)
                if stopped_early:
                    self.abort_nowait(rid)  # a stop string ended it: stop the scheduler's work on it
                yield chunk
        finally:
            self.states.pop(rid, None)
            self.router.release(replica)
            if state.timer is not None:
                state.timer.cancel()
            if not state.finished:
                if self.observer is not None:
                    self.observer.on_finish(
                        time.perf_counter() - state.created, state.prompt_tokens, state.completion_tokens, FINISH_ABORT
                    )
                if self.healthy:
                    # No await: this also runs when the consumer's task is being cancelled.
                    self.abort_nowait(rid)
            self._owner.pop(rid, None)

    def abort_nowait(self, rid: str) -> None:
        """Tell the scheduler to drop a request, without awaiting (safe in cancelled tasks)."""
        replica = self._owner.get(rid)
        if not self.healthy or replica is None:
            return
        # pyzmq annotates send() as returning an Awaitable; it is an asyncio Future, passed through.
        sent = asyncio.ensure_future(self._pushes[replica].send(codec.encode(AbortRequest(rid)), flags=zmq.NOBLOCK))

        def check(fut) -> None:
            if fut.cancelled() or fut.exception() is not None:
                logger.warning("the abort of request %s was not sent: %s", rid, fut.exception())

        sent.add_done_callback(check)

    async def _ask_all(self, msg: Message, waiters: list[list[asyncio.Future]], timeout_s: float) -> list:
        """Send `msg` to every replica; their answers, in replica order."""
        futs = []
        for i in range(len(self._pushes)):
            fut: asyncio.Future = asyncio.get_running_loop().create_future()
            waiters[i].append(fut)
            futs.append(fut)
            await self._send(msg, i)
        return await asyncio.wait_for(asyncio.gather(*futs), timeout_s)

    async def flush_cache(self, timeout_s: float = 30.0) -> FlushCacheResult:
        """Ask the scheduler(s) to empty their prefix cache (each refuses while requests run)."""
        results = await self._ask_all(FlushCacheRequest(), self._flush_waiters, timeout_s)
        refused = [r for r in results if not r.ok]
        if not refused or len(results) == 1:
            return results[0]
        flushed = [r.dp_rank for r in results if r.ok]
        return FlushCacheResult(False, f"replica {refused[0].dp_rank}: {refused[0].message}"
                                + (f" (replicas {flushed} flushed theirs)" if flushed else ""))

    async def get_stats(self, timeout_s: float = 10.0) -> SchedulerStats:
        """The scheduler's counters (with data parallelism, the replicas' summed)."""
        return sum_stats(await self._ask_all(StatsRequest(), self._stats_waiters, timeout_s))


def sum_stats(parts: list[SchedulerStats]) -> SchedulerStats:
    """The replicas' counters added up (histograms bucket by bucket)."""
    if len(parts) == 1:
        return parts[0]
    fields: dict[str, Any] = {}
    for name in SchedulerStats.__struct_fields__:
        values = [getattr(p, name) for p in parts]
        if isinstance(values[0], list):
            width = max(len(v) for v in values)
            fields[name] = [sum(v[i] for v in values if i < len(v)) for i in range(width)]
        else:
            fields[name] = sum(values)
    fields["dp_rank"] = 0
    return SchedulerStats(**fields)
