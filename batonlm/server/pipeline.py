"""The request pipeline every generation route runs on.

A route (chat completions, completions, /generate, and the API dialects to come) is a `Route`:
its request model, how its request becomes choices (a prompt's token ids and a SamplingParams
each), and how results are shaped, streamed (`Stream`) or whole (`answer`). `Route.handle`
runs the steps they share, in this order:

  read the body (size, deadline, JSON, the request limits, the request model) -> the model name
  and the server's health -> the route's checks -> its constraint -> admission (429 when
  full) -> its prompts' token ids -> a SamplingParams per choice -> each prompt validated
  (context, vocabulary, KV capacity) -> the events streamed, or the results collected.

A request with one choice streams straight from its TokenizerManager request; only several
choices are merged through a queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Generic, TypeVar

import orjson
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from batonlm.ipc.messages import ABOUT_CONSTRAINT, Pooling
from batonlm.request_checks import RequestRejected
from batonlm.sampling_params import SamplingParams
from batonlm.server.errors import bad_request, to_api_error
from batonlm.server.logprobs import prompt_token_logprobs
from batonlm.server.sse import DONE, sse
from batonlm.server.state import ServerState, server_state, until_disconnected
from batonlm.tokenizer_manager.manager import Admission
from batonlm.tokenizer_manager.offload import maybe_offload
from batonlm.tokenizer_manager.request_state import GenerationChunk, TokenLogprob
from batonlm.tokenizer_manager.stop_strings import StopStringMatcher

R = TypeVar("R", bound=BaseModel)


def request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass
class Job(Generic[R]):
    """A prepared request: its choices and what shaping its answer needs. Routes that need more
    (a tool plan, echoes) subclass it."""

    req: R
    rid: str
    created: int
    choices: list[tuple[list[int], SamplingParams]] = field(default_factory=list)  # (prompt ids, params)
    stop: list[str] = field(default_factory=list)  # stop strings, for every choice
    constraint: dict[str, str] = field(default_factory=dict)  # a SamplingParams constraint field
    constraint_param: str | None = None  # the request field the constraint came from (its errors name it)
    prompt_tokens: int = 0  # of the distinct prompts
    n: int = 1  # choices per prompt
    started: float = field(default_factory=time.perf_counter)
    admission: Admission | None = None  # the room admission took for its choices
    answer_values: int = 0  # collected: the tokens, logprobs and alternatives the answer holds
    priority: int = 0  # lower values first (--schedule-policy priority)
    pooling: Pooling | None = None  # an embedding request's pooling (its choices generate nothing)
    # A choice's stop rule beyond its stop strings (forced tool calls: chat_tools.ToolPlan.make_stop).
    make_stop: Callable[[list[str], SamplingParams], list[str] | StopStringMatcher] | None = None

    skip_special_tokens: bool = True  # False: the text keeps them (a tool-call format written in them)
    lora_key: int = 0  # the LoRA adapter (its load) its `model` selects (0: the base model)

    def stop_for(self, params: SamplingParams) -> list[str] | StopStringMatcher:
        return self.make_stop(self.stop, params) if self.make_stop is not None else self.stop

    def rejected(self, error: str, about: str | None) -> RequestRejected:
        """The scheduler's refusal as a 400, naming the field it is about."""
        return RequestRejected(error, self.constraint_param if about == ABOUT_CONSTRAINT else None)

    @property
    def stream(self) -> bool:
        return bool(getattr(self.req, "stream", False))


@dataclass
class ChoiceResult:
    """One choice's chunks, collected."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None  # with prompt logprobs asked
    spec: tuple[int, int] | None = None  # (verification steps, drafts accepted)
    finish_reason: str | None = None
    completion_tokens: int = 0
    error: str | None = None
    error_about: str | None = None
    cached_tokens: int = 0
    stop_string: str | None = None  # the stop string that ended the text
    preemptions: int = 0  # retractions for requests of higher priority
    embedding: list[float] | None = None  # an embedding request's pooled hidden states


class Stream(Generic[R]):
    """How one streamed request's chunks become event payloads (a route's subclass keeps the
    per-choice state its shaping needs), and how a payload is framed as a server-sent event
    (OpenAI's `data:` lines ending in [DONE]; a dialect may name its events and end otherwise)."""

    end: ClassVar[bytes | None] = DONE  # the stream's last line, after the closing events

    def __init__(self, state: ServerState, job: Job[R]) -> None:
        self.state, self.job = state, job

    def frame(self, payload: dict) -> bytes:
        return sse(payload)

    def opening(self) -> list[dict]:
        return []

    def events(self, i: int, chunk: GenerationChunk) -> list[dict]:
        raise NotImplementedError

    def closing(self) -> list[dict]:
        return []


class Route(Generic[R]):
    """One API dialect on the pipeline; subclasses fill in the hooks below `handle`."""

    request_model: ClassVar[type[BaseModel]]
    id_prefix: ClassVar[str]
    prompt_param: ClassVar[str]  # the field named when a prompt is too long or invalid
    stream_type: ClassVar[type[Stream]]
    job_type: ClassVar[type[Job]] = Job
    # The fields named when a whole answer would be too large: (with logprobs, without).
    size_params: ClassVar[tuple[str, str]] = ("logprobs", "max_tokens")
    generates: ClassVar[bool] = True  # False: served by an embedding-only model too

    async def handle(self, request: Request) -> Any:
        state = server_state(request)
        req = await state.read(request, self.request_model)
        return await self.handle_parsed(request, state, req)  # type: ignore[arg-type]  # an R: a ClassVar cannot say so

    async def handle_parsed(self, request: Request, state: ServerState, req: R) -> Any:
        """`handle` once the body is read and parsed (a route that looks at it first calls this)."""
        state.check_model(getattr(req, "model", None))
        state.check_healthy()
        if self.generates:
            state.check_generates()
        job = await self.prepare(state, req)
        if job.stream:
            if job.admission is not None:  # a body never iterated (its client gone) gives the room back too
                weakref.finalize(job, job.admission.release)
            return StreamingResponse(self.sse(state, job), media_type="text/event-stream")
        results = await until_disconnected(request, collect_choices(state, job, self.size_param(job)))
        return await json_answer(job.answer_values, lambda: self.answer(state, job, results))

    async def prepare(self, state: ServerState, req: R) -> Job[R]:
        job = self.job_type(req, self.request_id(req), int(time.time()))
        job.priority = getattr(req, "priority", 0)
        job.lora_key = self.lora_adapter(state, req)
        if job.priority != 0 and state.args.schedule_policy != "priority":
            raise bad_request("priority needs a server started with --schedule-policy priority", param="priority")
        self.check(state, job)
        await self.constrain(state, job)
        job.admission = state.manager.admit(self.num_choices(job), self.prompt_param)
        try:
            prompts = await self.prompts(state, job)
            for ids in prompts:
                params = self.sampling_params(state, job, ids)
                self.validate(state, job, ids, params[0])
                job.choices += [(ids, p) for p in params]
        except BaseException:
            job.admission.release()
            raise
        job.prompt_tokens = sum(len(ids) for ids in prompts)
        if not job.stream:
            try:
                self.check_answer_size(state, job)
            except BaseException:
                job.admission.release()
                raise
        return job

    def size_param(self, job: Job[R]) -> str:
        """The field named when the whole answer is too large."""
        logprobs = any(p.logprobs is not None or p.prompt_logprobs is not None for _, p in job.choices)
        return self.size_params[0 if logprobs else 1]

    def check_answer_size(self, state: ServerState, job: Job[R]) -> None:
        """Refuse a whole answer that surely exceeds --max-response-bytes: echoed prompt
        logprobs and the tokens every choice must generate (min_tokens, or max_tokens when EOS
        is ignored) are certain (one 307 KB request grew the frontend past 6 GB)."""
        values = 0
        for ids, p in job.choices:
            surely = p.max_new_tokens if p.ignore_eos else p.min_new_tokens
            values += surely * (1 + (0 if p.logprobs is None else 1 + p.logprobs))
            if p.prompt_logprobs is not None:
                values += (len(ids) - p.logprob_start_len) * (2 + p.prompt_logprobs)
        if values * BYTES_PER_VALUE > state.args.max_response_bytes:
            raise bad_request(
                f"the answer would take more than --max-response-bytes ({state.args.max_response_bytes} bytes: at "
                f"least {values * BYTES_PER_VALUE}); stream it (stream: true), or ask for fewer choices, tokens or "
                "logprobs", param=self.size_param(job), code="response_too_large")

    # ------------------------------------------------------------------ hooks
    def request_id(self, req: R) -> str:
        return request_id(self.id_prefix)

    def lora_adapter(self, state: ServerState, req: R) -> int:
        """The load key of the LoRA adapter the request selects (by its `model`; 0: none)."""
        return state.lora_adapter(getattr(req, "model", None))

    def check(self, state: ServerState, job: Job[R]) -> None:
        """The route's own checks of its request (the request limits on its top-level fields
        were checked on the raw body, `ServerState.read`); sets `job.stop`."""

    async def constrain(self, state: ServerState, job: Job[R]) -> None:
        """Check the request's constraint and set `job.constraint` (none by default)."""

    def num_choices(self, job: Job[R]) -> int:
        """How many requests admission counts."""
        return job.n

    async def prompts(self, state: ServerState, job: Job[R]) -> list[list[int]]:
        """The token ids of each prompt."""
        raise NotImplementedError

    def sampling_params(self, state: ServerState, job: Job[R], prompt_ids: list[int]) -> list[SamplingParams]:
        """One SamplingParams per choice of a prompt."""
        raise NotImplementedError

    def validate(self, state: ServerState, job: Job[R], prompt_ids: list[int], params: SamplingParams) -> None:
        """Reject what the scheduler would (context, vocabulary, KV capacity), naming the prompt."""
        state.manager.validate_prompt(prompt_ids, params, self.prompt_param)

    def answer(self, state: ServerState, job: Job[R], results: list[ChoiceResult]) -> dict:
        """The whole (non-streamed) answer."""
        raise NotImplementedError

    def error_event(self, error: Exception) -> dict:
        return to_api_error(error).body()

    # ------------------------------------------------------------------ streaming
    async def sse(self, state: ServerState, job: Job[R]) -> AsyncIterator[bytes]:
        """The SSE body: the stream's opening events, each chunk's, its closing ones, its end
        ([DONE]). An error after the response started becomes an error event."""
        stream = self.stream_type(state, job)
        for payload in stream.opening():
            yield stream.frame(payload)
        try:
            async for i, chunk in stream_choices(state, job):
                if chunk.error is not None:  # the scheduler refused it (a grammar that cannot compile, ...)
                    if chunk.token_ids:  # what it generated before, in the same chunk, still goes out first
                        before = replace(chunk, error=None, error_about=None, finish_reason=None)
                        yield b"".join([stream.frame(payload) for payload in stream.events(i, before)])
                    raise job.rejected(chunk.error, chunk.error_about)
                yield b"".join([stream.frame(payload) for payload in stream.events(i, chunk)])  # one write
        except Exception as e:
            yield stream.frame(self.error_event(e))
            if stream.end is not None:
                yield stream.end
            return
        for payload in stream.closing():
            yield stream.frame(payload)
        if stream.end is not None:
            yield stream.end


async def json_answer(size: int, build: Callable[[], Any]) -> Response:
    """A whole answer as JSON, built and serialised off the event loop when it is large (`size`
    values): 2,048 choices with logprobs take seconds, every other stream waiting meanwhile."""
    body = await maybe_offload(size, "text", lambda: orjson.dumps(build(), option=orjson.OPT_NON_STR_KEYS))
    return Response(body, media_type="application/json")


async def stream_choices(state: ServerState, job: Job) -> AsyncGenerator[tuple[int, GenerationChunk], None]:
    """Run every choice at once; yield (choice index, chunk) as they come. Cancelling the
    consumer cancels every choice (each aborts its request).

    One choice streams straight from its request. Several are merged through a queue, where at
    most a few chunks per choice wait for the consumer: one that does not consume (a stream
    whose client does not read) leaves the rest waiting in each request's own queue, where
    `max_stream_backlog` bounds them."""
    if len(job.choices) == 1:
        ((ids, params),) = job.choices
        # Closed with the consumer, at once (not when the collector finds it): that aborts it.
        gen = state.manager.generate(ids, params, rid=f"{job.rid}-0", stop=job.stop_for(params), admission=job.admission,
                                     priority=job.priority, pooling=job.pooling,
                                     skip_special_tokens=job.skip_special_tokens, lora_key=job.lora_key)
        try:
            async with contextlib.aclosing(gen):
                async for chunk in gen:
                    yield 0, chunk
        finally:
            if job.admission is not None:
                job.admission.release()
        return
    queue: asyncio.Queue = asyncio.Queue()
    room = asyncio.Semaphore(2 * len(job.choices))  # chunks (not ends or errors) allowed in the queue
    done = object()

    async def run(i: int, ids: list[int], params: SamplingParams) -> None:
        try:
            async for chunk in state.manager.generate(ids, params, rid=f"{job.rid}-{i}", stop=job.stop_for(params),
                                                      admission=job.admission, priority=job.priority,
                                                      pooling=job.pooling,
                                                      skip_special_tokens=job.skip_special_tokens, lora_key=job.lora_key):
                await room.acquire()
                queue.put_nowait((i, chunk))
        except Exception as e:  # reported to the consumer below
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, done))

    tasks = [asyncio.create_task(run(i, ids, p)) for i, (ids, p) in enumerate(job.choices)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                room.release()
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        if job.admission is not None:
            job.admission.release()  # choices cancelled before they started


# What one value (a token, a logprob, an alternative) takes in an answer's JSON at the least: a
# lower bound, so that only answers surely too large are refused.
BYTES_PER_VALUE = 16


async def collect_choices(state: ServerState, job: Job, size_param: str = "max_tokens") -> list[ChoiceResult]:
    """Every choice's chunks, collected; a 400 naming `size_param` when they grow past
    --max-response-bytes (the choices are aborted)."""
    results = [ChoiceResult() for _ in job.choices]
    budget = state.args.max_response_bytes // BYTES_PER_VALUE  # values
    async with contextlib.aclosing(stream_choices(state, job)) as chunks:
        async for i, chunk in chunks:
            job.answer_values += len(chunk.token_ids) + sum(2 + len(it.top or ()) for it in chunk.logprobs or ())
            job.answer_values += sum(2 + len(top) for top in chunk.prompt_top_logprobs or ())
            if job.answer_values > budget:  # closing the stream cancels every choice (each aborts its request)
                raise bad_request(f"the answer grew past --max-response-bytes ({state.args.max_response_bytes} "
                                  "bytes); stream it (stream: true), or ask for fewer choices, tokens or logprobs",
                                  param=size_param, code="response_too_large")
            _add(results[i], chunk, job.choices[i])
    for r in results:
        if r.error:
            raise job.rejected(r.error, r.error_about)
    return results


def _add(r: ChoiceResult, chunk: GenerationChunk, choice: tuple[list[int], SamplingParams]) -> None:
    r.text += chunk.text
    r.token_ids += chunk.token_ids
    r.completion_tokens = chunk.completion_tokens
    if chunk.cached_tokens is not None:
        r.cached_tokens = chunk.cached_tokens
    if chunk.logprobs:
        r.logprobs += chunk.logprobs
    if chunk.prompt_logprobs is not None:
        r.prompt_logprobs = prompt_token_logprobs(*choice, chunk)
    if chunk.spec is not None:
        r.spec = chunk.spec
    if chunk.embedding is not None:
        r.embedding = chunk.embedding
    if chunk.finish_reason is not None:
        r.finish_reason = chunk.finish_reason
        r.error, r.error_about = chunk.error, chunk.error_about
        r.stop_string = chunk.stop_string
        r.preemptions = chunk.preemptions


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: list[int], n: int) -> dict:
    """OpenAI's usage; `cached_tokens` per choice, of which every n-th (the first choice of
    each prompt) counts: a prompt's tokens are counted once however many choices it has."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": sum(cached_tokens[::n])},
    }
