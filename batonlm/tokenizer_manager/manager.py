"""TokenizerManager: the frontend's side of the scheduler, on one asyncio loop.

Turns requests into `GenerateRequest`s, sends them to the scheduler, and turns the token ids
that come back into text deltas per request. Owns the map request id -> waiting consumer; a
consumer that goes away aborts its request. It also keeps the server's request-level limits:
admission (`max_queued_requests`), `request_timeout`, `max_stream_backlog`, and the drain on
shutdown. The scheduler processes themselves (start, sockets, death, shutdown) are its
`SchedulerLink` (scheduler_link.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncGenerator, Callable
from typing import Any

from batonlm.config import ServerArgs
from batonlm.constrained.grammar import InvalidConstraint, check_constraint
from batonlm.ipc.messages import (
    AbortRequest,
    BatchOutput,
    FlushCacheRequest,
    FlushCacheResult,
    GenerateRequest,
    LoadLoRARequest,
    LoRAResult,
    Pooling,
    SchedulerInfo,
    SchedulerStats,
    StatsRequest,
    UnloadLoRARequest,
)
from batonlm.request_checks import RequestRejected, check_request
from batonlm.sampling_params import InvalidSamplingParams, SamplingParams
from batonlm.tokenizer_manager.detokenizer import IncrementalDetokenizer
from batonlm.tokenizer_manager.dp_router import DPRouter
from batonlm.tokenizer_manager.offload import maybe_offload
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
from batonlm.tokenizer_manager.scheduler_link import LaunchScheduler, SchedulerLink, SchedulerProcess
from batonlm.tokenizer_manager.stop_strings import StopStringMatcher
from batonlm.tokenizer_manager.tokenizer import load_tokenizer
from batonlm.tokenizer_manager.watchdog import Watchdog

logger = logging.getLogger(__name__)


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
        self.link = SchedulerLink(args, launch, self._route_outputs, self._fail_all)
        # `router` picks a request's data-parallel replica (always 0 without --dp).
        self.router = DPRouter(args.dp_size, args.load_balance_method)
        self._owner: dict[str, int] = {}  # request id -> its replica
        self.states: dict[str, RequestState] = {}
        self._reserved = 0  # requests admitted and not sent yet (Admission)
        self.draining = False
        self.observer: RequestObserver | None = None
        self._watchdog: asyncio.Task | None = None
        self.lora_inflight: Counter[int] = Counter()  # LoRA adapter load (key) -> its requests running

    # The scheduler(s), as the link to them sees them.
    @property
    def info(self) -> SchedulerInfo | None:
        return self.link.info

    @info.setter
    def info(self, value: SchedulerInfo | None) -> None:
        self.link.info = value

    @property
    def healthy(self) -> bool:
        return self.link.healthy

    @healthy.setter
    def healthy(self, value: bool) -> None:
        self.link.healthy = value

    @property
    def handle(self) -> SchedulerProcess | None:
        """The (first replica's) scheduler."""
        return self.link.handles[0] if self.link.handles else None

    @property
    def on_scheduler_death(self) -> Callable[[], None] | None:
        return self.link.on_death

    @on_scheduler_death.setter
    def on_scheduler_death(self, callback: Callable[[], None] | None) -> None:
        self.link.on_death = callback

    async def start_with_tokenizer(self) -> SchedulerInfo:
        """`start`, and meanwhile load the tokenizer (when the manager was made without one):
        each spends seconds importing transformers and torch, which two cores do at once. A
        tokenizer that fails to load (TokenizerLoadError) cancels the start: no model is loaded
        for nothing."""
        start = asyncio.create_task(self.start())
        try:
            if self.tokenizer is None:
                self.tokenizer = await asyncio.to_thread(load_tokenizer, self.args.tokenizer or self.args.model)
        except BaseException:
            start.cancel()
            await asyncio.gather(start, return_exceptions=True)
            raise
        return await start

    async def start(self) -> SchedulerInfo:
        """Spawn the scheduler(s) and wait until they have loaded the model; then watch them."""
        info = await self.link.start()
        watchdog = Watchdog(self.args.watchdog_timeout, self.router.in_flight, self.link.last_heard, self._stuck)
        self._watchdog = asyncio.create_task(watchdog.run())
        return info

    async def shutdown(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        await self.link.shutdown()

    def _stuck(self, replica: int, quiet_s: float) -> None:
        which = "the scheduler" if self.args.dp_size == 1 else f"the scheduler of replica {replica}"
        logger.error("%s finished no iteration for %.0f s with %d request(s) waiting (--watchdog-timeout %g s): it, "
                     "its device worker or a rank is stopped or hung; stopping the server", which, quiet_s,
                     self.router.in_flight[replica], self.args.watchdog_timeout)
        self._fail_all(SchedulerGone(f"the server is stuck ({which} made no progress for {quiet_s:.0f} s)"))
        self.link.kill()  # the processes' exit takes the server down (exit code 1)

    # ------------------------------------------------------------------ lifecycle
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

    def _route_outputs(self, msg: BatchOutput) -> None:
        """Each output to its request's state (the link hands every BatchOutput here)."""
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

    # ------------------------------------------------------------------ requests
    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids)

    def tokenize_many(self, prompts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [list(ids) for ids in self.tokenizer(prompts, add_special_tokens=add_special_tokens).input_ids]

    async def tokenize_async(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return await maybe_offload(len(prompt), "text", self.tokenize, prompt, add_special_tokens)

    async def tokenize_many_async(self, prompts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Several prompts at once, off the loop when together they are long (256 prompts of
        8,000 characters each stalled every client for 1.6 s when tokenized one by one inline)."""
        size = sum(map(len, prompts))
        return await maybe_offload(size, "text", self.tokenize_many, prompts, add_special_tokens)

    async def detokenize_async(self, token_ids: list[int]) -> str:
        return await maybe_offload(len(token_ids), "text", self.tokenizer.decode, token_ids)

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
        stop: list[str] | StopStringMatcher | None = None,
        admission: Admission | None = None,
        priority: int = 0,
        pooling: Pooling | None = None,
        skip_special_tokens: bool = True,
        lora_key: int = 0,
    ) -> AsyncGenerator[GenerationChunk, None]:
        """Stream one request's chunks. A stop string ends it with "stop" (the string and what
        follows are trimmed). Leaving the iteration early aborts the request, as do the
        request timeout and a consumer that falls too far behind (those raise).

        `rid` is only a label: the scheduler sees a fresh id, so a client reusing an id can never
        receive the late outputs of an earlier request that had that id. With `pooling` it is an
        embedding request: its first chunk carries the pooled hidden states."""
        rid = f"{rid or 'req'}-{uuid.uuid4().hex}"
        state = RequestState(
            rid, IncrementalDetokenizer(self.tokenizer, input_ids, skip_special_tokens),
            stop if isinstance(stop, StopStringMatcher) else StopStringMatcher(stop or []), len(input_ids),
            min_tokens=params.min_new_tokens, generates=pooling is None,
        )
        timeout = self.args.request_timeout
        if timeout is not None:
            error = RequestTimedOut(f"the request ran longer than the server's request timeout ({timeout:g} s)")
            state.timer = asyncio.get_running_loop().call_later(timeout, state.fail, error)
        self.states[rid] = state
        if admission is not None:
            admission.take()  # counted in `states` from now on
        if lora_key:
            self.lora_inflight[lora_key] += 1
        replica = self._owner[rid] = self.router.choose(input_ids)
        try:
            await self.link.send(GenerateRequest(rid, input_ids, params, priority, pooling, lora_key), replica)
            while not state.finished:
                chunk, stopped_early = state.apply(await state.next(), self.observer)
                if stopped_early:
                    self.abort_nowait(rid)  # a stop string ended it: stop the scheduler's work on it
                yield chunk
        finally:
            self.states.pop(rid, None)
            self.router.release(replica)
            if lora_key:
                self.lora_inflight[lora_key] -= 1
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
        sent = self.link.send_nowait(AbortRequest(rid), replica)

        def check(fut) -> None:
            if fut.cancelled() or fut.exception() is not None:
                logger.warning("the abort of request %s was not sent: %s", rid, fut.exception())

        sent.add_done_callback(check)

    async def flush_cache(self, timeout_s: float = 30.0) -> FlushCacheResult:
        """Ask the scheduler(s) to empty their prefix cache (each refuses while requests run)."""
        results = await self.link.ask_all(FlushCacheRequest(), FlushCacheResult, timeout_s)
        refused = [r for r in results if not r.ok]
        if not refused or len(results) == 1:
            return results[0]
        flushed = [r.dp_rank for r in results if r.ok]
        return FlushCacheResult(False, f"replica {refused[0].dp_rank}: {refused[0].message}"
                                + (f" (replicas {flushed} flushed theirs)" if flushed else ""))

    async def update_lora(self, msg: LoadLoRARequest | UnloadLoRARequest, timeout_s: float = 60.0) -> LoRAResult:
        """Load a LoRA adapter (checked) on every replica, or unload one."""
        results = await self.link.ask_all(msg, LoRAResult, timeout_s)
        refused = [r for r in results if not r.ok]
        return refused[0] if refused else results[0]

    async def get_stats(self, timeout_s: float = 10.0) -> SchedulerStats:
        """The scheduler's counters (with data parallelism, the replicas' summed)."""
        return sum_stats(await self.link.ask_all(StatsRequest(), SchedulerStats, timeout_s))


def sum_stats(parts: list[SchedulerStats]) -> SchedulerStats:
    """The replicas' counters added up (histograms bucket by bucket)."""
    if len(parts) == 1:
        return parts[0]
    fields: dict[str, Any] = {}
    for name in SchedulerStats.__struct_fields__:
        values = [getattr(p, name) for p in parts]
        if isinstance(values[0], dict):  # counts by key
            fields[name] = {k: sum(v.get(k, 0) for v in values) for k in sorted({k for v in values for k in v})}
        elif isinstance(values[0], list):
            width = max(len(v) for v in values)
            fields[name] = [sum(v[i] for v in values if i < len(v)) for i in range(width)]
        else:
            fields[name] = sum(values)
    fields["dp_rank"] = 0
    return SchedulerStats(**fields)
