"""What the chat and text completion routes share: their place on the request pipeline
(`OpenAIRoute`, `OpenAIStream`: OpenAI's answer and chunk shapes, usage), the sampling record
from OpenAI's fields, the constraint from response_format / regex / ebnf, chat rendering."""

from __future__ import annotations

import json
from typing import Any, ClassVar, TypeVar

from batonlm.constrained.grammar import JSON_OBJECT_SCHEMA, InvalidConstraint, check_constraint
from batonlm.sampling_params import SamplingParams
from batonlm.server.errors import bad_request, rename_param
from batonlm.server.pipeline import ChoiceResult, Job, Route, Stream, usage
from batonlm.server.protocol import SamplingFields
from batonlm.server.state import ServerState
from batonlm.tokenizer_manager.chat_template import apply_chat_template
from batonlm.tokenizer_manager.offload import maybe_offload, offload
from batonlm.tokenizer_manager.request_state import GenerationChunk

F = TypeVar("F", bound=SamplingFields)


# Conversations longer than this (in characters) are rendered and tokenized in a thread.


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

    if tools:  # their schemas go through the template too: off the loop whatever the messages' size
        return await offload("text", render)
    return await maybe_offload(sum(len(m["content"] or "") for m in messages), "text", render)


def num_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> int:
    """The prompts of an OpenAI `prompt` / `input`: a text, texts, token ids, or lists of them."""
    return 1 if isinstance(prompt, str) or all(isinstance(p, int) for p in prompt) else len(prompt)


async def prompt_ids(state: ServerState, prompt: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
    """The token ids of each prompt of an OpenAI `prompt` / `input`."""
    if isinstance(prompt, str):
        return [await state.manager.tokenize_async(prompt)]
    if all(isinstance(p, int) for p in prompt):
        return [[p for p in prompt if isinstance(p, int)]]
    return await tokenize_prompts(state, prompt)


async def tokenize_prompts(state: ServerState, prompts: list) -> list[list[int]]:
    """A batch of prompts, each a text or token ids: the texts tokenized together (off the loop
    when together they are long)."""
    texts = [p for p in prompts if isinstance(p, str)]
    ids = iter(await state.manager.tokenize_many_async(texts) if texts else [])
    return [next(ids) if isinstance(p, str) else list(p) for p in prompts]


# SamplingParams fields an OpenAI request names otherwise or gives in another form; the others
# are taken from the request's field of the same name.
_NOT_BY_NAME = {"max_new_tokens", "min_new_tokens", "logprobs", "logit_bias", "prompt_logprobs", "logprob_start_len",
                "json_schema", "regex", "ebnf"}


def sampling_params(
    state: ServerState, req: SamplingFields, prompt_len: int, param: str, constraint: dict[str, str]
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
    same: dict[str, Any] = {name: value for name in SamplingParams.__struct_fields__
            if name not in _NOT_BY_NAME and (value := getattr(req, name, None)) is not None}
    same.update(constraint)  # its one field, if any: json_schema, regex or ebnf
    # The request model has checked every value against SamplingParams' ranges already.
    base = SamplingParams(
        **same,
        max_new_tokens=max_new,
        min_new_tokens=req.min_tokens,
        logit_bias={int(k): v for k, v in (req.logit_bias or {}).items()},
        logprobs=req.num_logprobs,
    )
    return base.for_choices(req.n)


async def check_constraint_param(kind: str, text: str, param: str, max_bytes: int, what: str | None = None) -> None:
    """Parse a constraint in a thread (a pathological one, a regex like a{100000}, takes
    seconds); a 400 naming `param` when it is larger than `max_bytes` or does not parse."""
    size = len(text.encode())
    if size > max_bytes:
        raise bad_request(f"the {what or kind.replace('_', ' ')} is {size} bytes; at most {max_bytes} are allowed "
                          "(--max-constraint-bytes)", param=param, code="limit_exceeded")
    try:
        await maybe_offload(len(text), "constraint", check_constraint, kind, text)
    except InvalidConstraint as e:
        raise bad_request(f"invalid {what or kind.replace('_', ' ')}: {e}", param=param) from None


async def request_constraint(req: SamplingFields, max_bytes: int) -> dict[str, str]:
    """The SamplingParams constraint field of a request's response_format / regex / ebnf: at
    most one, and it parses, else a 400 naming the field the user wrote."""
    given = _constraints(req)
    if not given:
        return {}
    if len(given) > 1:
        raise bad_request(f"give at most one of response_format (JSON), regex and ebnf, got {given[0][2]} and "
                          f"{given[1][2]}", param=given[1][2])
    kind, text, field_name = given[0]
    await check_constraint_param(kind, text, field_name, max_bytes)
    return {kind: text}


def constraint_field(req: SamplingFields, forced_tools: bool = False,
                     renames: tuple[tuple[str, str], ...] = ()) -> str | None:
    """The request field its constraint comes from, if any: tool_choice when it forces tool calls,
    else response_format, regex or ebnf (as a dialect read as chat names it: `renames`)."""
    if forced_tools:
        return "tool_choice"
    given = _constraints(req)
    return rename_param(given[0][2], renames) if given else None


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


class OpenAIRoute(Route[F]):
    """Chat and text completions on the pipeline: stop strings, limits and the constraint from
    OpenAI's fields, OpenAI's answer around the route's choices."""

    object_name: ClassVar[str]  # the answer's `object`

    def check(self, state: ServerState, job: Job[F]) -> None:
        job.stop, job.n = job.req.stop_strings, job.req.n

    async def constrain(self, state: ServerState, job: Job[F]) -> None:
        job.constraint = await request_constraint(job.req, state.args.max_constraint_bytes)
        job.constraint_param = constraint_field(job.req)

    def sampling_params(self, state: ServerState, job: Job[F], prompt_ids: list[int]) -> list[SamplingParams]:
        return sampling_params(state, job.req, len(prompt_ids), self.prompt_param, job.constraint)

    def answer(self, state: ServerState, job: Job[F], results: list[ChoiceResult]) -> dict:
        return {
            "id": job.rid,
            "object": self.object_name,
            "created": job.created,
            "model": state.model_name,
            "choices": self.choices(state, job, results),
            "usage": usage(job.prompt_tokens, sum(r.completion_tokens for r in results),
                           [r.cached_tokens for r in results], job.n),
        }

    def choices(self, state: ServerState, job: Job[F], results: list[ChoiceResult]) -> list[dict]:
        raise NotImplementedError


class OpenAIStream(Stream[F]):
    """A streamed chat or text completion: each choice payload in OpenAI's chunk, and the usage
    chunk at the end when `stream_options.include_usage` asks for it; with
    `continuous_usage_stats` (vLLM's) every chunk carries the usage so far."""

    object_name: ClassVar[str]
    counts_completion: bool = True  # False: a prompt-only request (no completion tokens)

    def __init__(self, state: ServerState, job: Job[F]) -> None:
        super().__init__(state, job)
        self.completion_tokens = [0] * len(job.choices)
        self.cached = [0] * len(job.choices)
        self.usage_field: dict[str, Any] = {"usage": None} if job.req.include_usage else {}
        self.continuous = job.req.continuous_usage

    def chunk(self, choices: list[dict], **extra: Any) -> dict:
        job = self.job
        so_far = {"usage": self.usage()} if self.continuous else {}
        return {"id": job.rid, "object": self.object_name, "created": job.created, "model": self.state.model_name,
                "choices": choices, **self.usage_field, **so_far, **extra}

    def usage(self) -> dict:
        job = self.job
        return usage(job.prompt_tokens, sum(self.completion_tokens), self.cached, job.n)

    def events(self, i: int, chunk: GenerationChunk) -> list[dict]:
        self.completion_tokens[i] = chunk.completion_tokens if self.counts_completion else 0
        if chunk.cached_tokens is not None:
            self.cached[i] = chunk.cached_tokens
        return [self.chunk([choice]) for choice in self.choice_deltas(i, chunk)]

    def choice_deltas(self, i: int, chunk: GenerationChunk) -> list[dict]:
        raise NotImplementedError

    def closing(self) -> list[dict]:
        if not self.job.req.include_usage:
            return []
        return [self.chunk([], usage=self.usage())]
