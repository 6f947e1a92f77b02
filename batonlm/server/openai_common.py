"""Pieces shared by the chat and text completion endpoints."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import msgspec

from batonlm.constrained.grammar import JSON_OBJECT_SCHEMA, InvalidConstraint, check_constraint
from batonlm.request_checks import RequestRejected
from batonlm.sampling_params import SamplingParams
from batonlm.server import limits
from batonlm.server.errors import bad_request, to_api_error
from batonlm.server.logprobs import prompt_token_logprobs
from batonlm.server.protocol import SamplingFields
from batonlm.server.sse import DONE, sse
from batonlm.server.state import ServerState
from batonlm.tokenizer_manager.chat_template import apply_chat_template
from batonlm.tokenizer_manager.request_state import GenerationChunk, TokenLogprob


def request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# Conversations longer than this (in characters) are rendered and tokenized in a thread.
RENDER_INLINE_CHARS = 8192


async def render_chat(
    state: ServerState, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
) -> list[int]:
    """The conversation's token ids through the chat template (400 naming `messages` if the
    template rejects it)."""

    def render() -> list[int]:
        try:
            return apply_chat_template(state.tokenizer, messages, add_generation_prompt, tools)
        except Exception as e:
            raise bad_request(f"the chat template failed on these messages: {e}", param="messages") from None

    if sum(len(m["content"] or "") for m in messages) <= RENDER_INLINE_CHARS and not tools:
        return render()
    return await asyncio.to_thread(render)


def check_limits(state: ServerState, req: SamplingFields) -> None:
    """The request limits (batonlm/server/limits.py) on the request's fields."""
    limits.check_limits(state.args, dict(req))


def sampling_params(
    state: ServerState, req: SamplingFields, prompt_len: int, num_logprobs: int | None, param: str,
    constraint: dict[str, str],
) -> list[SamplingParams]:
    """One SamplingParams per choice (choice i of a seeded request uses seed + i), with the
    request's constraint (`request_constraint`, or the one a tool_choice forcing calls made)."""
    info = state.manager.info
    assert info is not None
    ctx = info.context_length
    wanted = req.requested_max_tokens
    if prompt_len >= ctx:
        raise bad_request(
            f"This model's maximum context length is {ctx} tokens. However, your prompt has {prompt_len} "
            "tokens. Please reduce the length of the prompt.",
            param=param,
            code="context_length_exceeded",
        )
    if wanted is not None and prompt_len + wanted > ctx:
        raise bad_request(
            f"This model's maximum context length is {ctx} tokens. However, you requested "
            f"{prompt_len + wanted} tokens ({prompt_len} in the prompt, {wanted} in the completion). "
            "Please reduce the length of the prompt or completion.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    max_new = wanted if wanted is not None else ctx - prompt_len
    if req.min_tokens > max_new:
        raise bad_request(f"min_tokens ({req.min_tokens}) exceeds max_tokens ({max_new})", param="min_tokens")
    # The request model has checked every value against SamplingParams' ranges already.
    base = SamplingParams(
        max_new_tokens=max_new,
        min_new_tokens=req.min_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        seed=req.seed,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        frequency_penalty=req.frequency_penalty,
        presence_penalty=req.presence_penalty,
        repetition_penalty=req.repetition_penalty,
        logit_bias={int(k): v for k, v in (req.logit_bias or {}).items()},
        logprobs=num_logprobs,
        **constraint,
    )
    if req.seed is None:
        return [base] * req.n
    # Seeds stay in the int64 range SamplingParams states: choice i uses seed + i, wrapped.
    return [msgspec.structs.replace(base, seed=_wrap_int64(req.seed + i)) for i in range(req.n)]


async def check_constraint_param(kind: str, text: str, param: str, what: str | None = None) -> None:
    """Parse a constraint in a thread (a pathological one, a regex like a{100000}, takes
    seconds); a 400 naming `param` when it does not parse."""
    try:
        await asyncio.to_thread(check_constraint, kind, text)
    except InvalidConstraint as e:
        raise bad_request(f"invalid {what or kind.replace('_', ' ')}: {e}", param=param) from None


async def request_constraint(req: SamplingFields) -> dict[str, str]:
    """The SamplingParams constraint field of a request's response_format / regex / ebnf: at
    most one, and it parses, else a 400 naming the field the user wrote."""
    given = _constraints(req)
    if not given:
        return {}
    if len(given) > 1:
        raise bad_request(f"give at most one of response_format (JSON), regex and ebnf, got {given[0][2]} and "
                          f"{given[1][2]}", param=given[1][2])
    kind, text, field_name = given[0]
    await check_constraint_param(kind, text, field_name)
    return {kind: text}


def _constraints(req: SamplingFields) -> list[tuple[str, str, str]]:
    given: list[tuple[str, str, str]] = []  # (kind, text, request field)
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        given.append(("json_schema", JSON_OBJECT_SCHEMA, "response_format"))
    elif rf is not None and rf.type == "json_schema":
        assert rf.json_schema is not None
        given.append(("json_schema", json.dumps(rf.json_schema.schema_), "response_format.json_schema.schema"))
    for kind in ("regex", "ebnf"):
        if getattr(req, kind) is not None:
            given.append((kind, getattr(req, kind), kind))
    return given


def _wrap_int64(x: int) -> int:
    return (x + 2**63) % 2**64 - 2**63


@dataclass
class ChoiceResult:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None  # with prompt logprobs asked
    spec: tuple[int, int] | None = None  # (verification steps, drafts accepted)
    finish_reason: str | None = None
    completion_tokens: int = 0
    error: str | None = None
    cached_tokens: int = 0


async def stream_choices(
    state: ServerState, jobs: list[tuple[list[int], SamplingParams]], stop: list[str], rid: str
) -> AsyncIterator[tuple[int, GenerationChunk]]:
    """Run every choice at once; yield (choice index, chunk) as they come. Cancelling the
    consumer cancels every choice (each aborts its request).

    At most a few chunks per choice wait here for the consumer: one that does not consume (a
    stream whose client does not read) leaves the rest waiting in each request's own queue,
    where `max_stream_backlog` bounds them."""
    queue: asyncio.Queue = asyncio.Queue()
    room = asyncio.Semaphore(2 * len(jobs))  # chunks (not ends or errors) allowed in the queue
    done = object()

    async def run(i: int, ids: list[int], params: SamplingParams) -> None:
        try:
            async for chunk in state.manager.generate(ids, params, rid=f"{rid}-{i}", stop=stop):
                await room.acquire()
                queue.put_nowait((i, chunk))
        except Exception as e:  # reported to the consumer below
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, done))

    tasks = [asyncio.create_task(run(i, ids, p)) for i, (ids, p) in enumerate(jobs)]
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


async def sse_body(
    state: ServerState,
    jobs: list[tuple[list[int], SamplingParams]],
    stop: list[str],
    rid: str,
    *,
    obj: str,
    created: int,
    include_usage: bool,
    prompt_tokens: int,
    choices_per_prompt: int,
    opening: list[dict],
    to_choices: Callable[[int, GenerationChunk], list[dict]],
    count_completion: bool = True,
) -> AsyncIterator[bytes]:
    """The SSE body of a streamed completion: `opening` choices, then what `to_choices` makes
    of each chunk, one event per choice, an optional usage event (`count_completion` False: a
    prompt-only request, no completion tokens), and [DONE]. An error after the response started
    becomes an error event."""
    usage_field = {"usage": None} if include_usage else {}
    cached = [0] * len(jobs)

    def event(choices: list[dict], **extra) -> bytes:
        return sse({"id": rid, "object": obj, "created": created, "model": state.model_name, "choices": choices,
                    **usage_field, **extra})

    for choice in opening:
        yield event([choice])
    completion_tokens = [0] * len(jobs)
    try:
        async for i, chunk in stream_choices(state, jobs, stop, rid):
            completion_tokens[i] = chunk.completion_tokens if count_completion else 0
            if chunk.cached_tokens is not None:
                cached[i] = chunk.cached_tokens
            for choice in to_choices(i, chunk):
                yield event([choice])
    except Exception as e:
        yield sse(to_api_error(e).body())
        yield DONE
        return
    if include_usage:
        yield event([], usage=usage(prompt_tokens, sum(completion_tokens), cached, choices_per_prompt))
    yield DONE


async def collect_choices(
    state: ServerState, jobs: list[tuple[list[int], SamplingParams]], stop: list[str], rid: str
) -> list[ChoiceResult]:
    results = [ChoiceResult() for _ in jobs]
    async for i, chunk in stream_choices(state, jobs, stop, rid):
        r = results[i]
        r.text += chunk.text
        r.token_ids += chunk.token_ids
        r.completion_tokens = chunk.completion_tokens
        if chunk.cached_tokens is not None:
            r.cached_tokens = chunk.cached_tokens
        if chunk.logprobs:
            r.logprobs += chunk.logprobs
        if chunk.prompt_logprobs is not None:
            r.prompt_logprobs = prompt_token_logprobs(*jobs[i], chunk)
        if chunk.spec is not None:
            r.spec = chunk.spec
        if chunk.finish_reason is not None:
            r.finish_reason = chunk.finish_reason
            r.error = chunk.error
    for r in results:
        if r.error:
            raise RequestRejected(r.error)
    return results


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: list[int], n: int) -> dict:
    """OpenAI's usage; `cached_tokens` per choice, of which every n-th (the first choice of
    each prompt) counts: a prompt's tokens are counted once however many choices it has."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": sum(cached_tokens[::n])},
    }
