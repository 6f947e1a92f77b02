"""Anthropic's Messages API on the request pipeline: POST /v1/messages (whole or streamed with
Anthropic's named events) and POST /v1/messages/count_tokens.

A Messages request is read as the chat request it means (`MessagesRequest.to_chat`): the same
chat template, tool plan (tool_choice any -> required, tool -> named), constraint
(output_config.format -> a JSON schema) and sampling as /v1/chat/completions, shaped as
Anthropic's content blocks (thinking from --reasoning-parser, text, tool_use) and stop reasons.
Errors on these routes are Anthropic-shaped (`errors.dialect_of`), and `x-api-key` is accepted
as the API key (`guard.py`).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request

from batonlm.sampling_params import SamplingParams
from batonlm.server import chat_tools
from batonlm.server.anthropic_protocol import CountTokensRequest, MessagesRequest
from batonlm.server.errors import bad_request, renamed_params, to_api_error
from batonlm.server.openai_common import constraint_field, render_chat, request_constraint, sampling_params
from batonlm.server.pipeline import ChoiceResult, Job, Route, Stream
from batonlm.server.protocol import ChatCompletionRequest
from batonlm.server.sse import named_sse
from batonlm.server.state import ServerState, server_state
from batonlm.tokenizer_manager.request_state import GenerationChunk
from batonlm.tool_calls.parser import ToolCall

router = APIRouter()

# The chat request's field names in errors, as the Messages request names them.
_RENAMES = ((r"^tools\.(\d+)\.function\.parameters", r"tools.\1.input_schema"),
            (r"^response_format(\.json_schema)?", "output_config.format"), (r"^stop$", "stop_sequences"))


@dataclass
class MessagesJob(Job[MessagesRequest]):
    chat: ChatCompletionRequest | None = None  # the chat request it means
    plan: chat_tools.ToolPlan | None = None


def stop_reason(finish: str | None, calls: list[ToolCall], stop_string: str | None) -> str | None:
    """Anthropic's stop_reason of a finish reason."""
    if finish == "stop":
        return "tool_use" if calls else "stop_sequence" if stop_string is not None else "end_turn"
    if finish == "length":  # complete calls before the cut are still returned, as tool_use blocks
        return "max_tokens"
    return None if finish is None else "end_turn"


def tool_use(call: ToolCall) -> dict[str, Any]:
    args = json.loads(call.arguments)  # the parsers give JSON objects
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
            "input": args if isinstance(args, dict) else {"value": args}}


def usage(prompt_tokens: int, cached: int, output_tokens: int) -> dict[str, int]:
    """Anthropic's usage: `input_tokens` are those the prefix cache did not serve."""
    return {"input_tokens": prompt_tokens - cached, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


class MessagesStream(Stream[MessagesRequest]):
    """message_start, ping; per block content_block_start, its deltas, content_block_stop;
    message_delta (stop_reason, usage), message_stop. No [DONE]."""

    end = None
    job: MessagesJob

    def __init__(self, state: ServerState, job: MessagesJob) -> None:
        super().__init__(state, job)
        assert job.plan is not None
        self.output = chat_tools.ChoiceOutput(job.plan, state.args.reasoning_parser)
        self.block: str | None = None  # the open block's type
        self.index = -1  # of the open (or last) block
        self.output_tokens = self.cached = 0
        self.reason: str | None = None
        self.stop_string: str | None = None

    def frame(self, payload: dict) -> bytes:
        return named_sse(payload)

    def opening(self) -> list[dict]:
        job = self.job
        message: dict[str, Any] = {"id": job.rid, "type": "message", "role": "assistant", "model": self.state.model_name,
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": usage(job.prompt_tokens, 0, 0)}
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    def _open(self, kind: str, block: dict[str, Any] | None = None) -> list[dict]:
        if self.block == kind and block is None:
            return []
        out = self._close()
        self.index += 1
        self.block = kind
        start = block or ({"type": "text", "text": ""} if kind == "text" else
                          {"type": "thinking", "thinking": "", "signature": ""})
        return out + [{"type": "content_block_start", "index": self.index, "content_block": start}]

    def _close(self) -> list[dict]:
        if self.block is None:
            return []
        self.block = None
        return [{"type": "content_block_stop", "index": self.index}]

    def _delta(self, delta: dict[str, Any]) -> dict:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}

    def events(self, i: int, chunk: GenerationChunk) -> list[dict]:
        self.output_tokens = chunk.completion_tokens
        if chunk.cached_tokens is not None:
            self.cached = chunk.cached_tokens
        last = chunk.finish_reason is not None
        reasoning, text, deltas, calls = self.output.feed(chunk.text, last)
        out: list[dict] = []
        if reasoning:
            out += self._open("thinking")
            out.append(self._delta({"type": "thinking_delta", "thinking": reasoning}))
        if text:
            out += self._open("text")
            out.append(self._delta({"type": "text_delta", "text": text}))
        for d in deltas:  # a tool_use block opens with its name; its input follows as it is written
            if d.name is not None:
                out += self._open("tool_use", {**tool_use(ToolCall(d.name, "{}", d.id)), "input": {}})
            if d.arguments:
                out.append(self._delta({"type": "input_json_delta", "partial_json": d.arguments}))
        if last:
            out += self._close()
            self.reason = stop_reason(chunk.finish_reason, calls, chunk.stop_string)
            self.stop_string = chunk.stop_string if self.reason == "stop_sequence" else None
        return out

    def closing(self) -> list[dict]:
        delta = {"stop_reason": self.reason, "stop_sequence": self.stop_string}
        return [{"type": "message_delta", "delta": delta,
                 "usage": usage(self.job.prompt_tokens, self.cached, self.output_tokens)},
                {"type": "message_stop"}]


class MessagesRoute(Route[MessagesRequest]):
    request_model = MessagesRequest
    id_prefix = "msg"
    prompt_param = "messages"
    size_params = ("max_tokens", "max_tokens")
    stream_type = MessagesStream
    job_type = MessagesJob
    # Its hooks take a MessagesJob (job_type makes it), narrower than Route's Job: hence the override ignores.

    def request_id(self, req: MessagesRequest) -> str:
        return f"msg_{uuid.uuid4().hex[:24]}"

    def check(self, state: ServerState, job: MessagesJob) -> None:  # type: ignore[override]
        thinking = job.req.thinking
        if thinking is not None and thinking.type != "disabled" and state.args.reasoning_parser == "none":
            raise bad_request("thinking needs a server started with --reasoning-parser (the model's reasoning "
                              "is split off by it)", param="thinking")
        job.chat = job.req.to_chat()
        job.stop = job.chat.stop_strings

    async def constrain(self, state: ServerState, job: MessagesJob) -> None:  # type: ignore[override]
        assert job.chat is not None
        with renamed_params(_RENAMES):
            job.constraint = await request_constraint(job.chat, state.args.max_constraint_bytes)
            job.plan = await chat_tools.plan_tools(state, job.chat)
        job.constraint = job.plan.constraint or job.constraint
        job.constraint_param = constraint_field(job.chat, bool(job.plan.constraint), _RENAMES)
        job.make_stop = job.plan.make_stop
        job.skip_special_tokens = job.plan.skip_special_tokens

    async def prompts(self, state: ServerState, job: MessagesJob) -> list[list[int]]:  # type: ignore[override]
        assert job.chat is not None and job.plan is not None
        return [await render_chat(state, [m.template_dict() for m in job.chat.messages], tools=job.plan.template_tools)]

    def sampling_params(self, state: ServerState, job: MessagesJob,  # type: ignore[override]
                        prompt_ids: list[int]) -> list[SamplingParams]:
        assert job.chat is not None
        with renamed_params(_RENAMES):
            return sampling_params(state, job.chat, len(prompt_ids), self.prompt_param, job.constraint)

    def answer(self, state: ServerState, job: MessagesJob, results: list[ChoiceResult]) -> dict:  # type: ignore[override]
        assert job.plan is not None
        (r,) = results
        reasoning, content, calls = chat_tools.whole_output(job.plan, state.args.reasoning_parser, r.text)
        blocks: list[dict[str, Any]] = []
        if reasoning:
            blocks.append({"type": "thinking", "thinking": reasoning, "signature": ""})
        if content:
            blocks.append({"type": "text", "text": content})
        blocks += [tool_use(c) for c in calls]
        reason = stop_reason(r.finish_reason, calls, r.stop_string)
        return {"id": job.rid, "type": "message", "role": "assistant", "model": state.model_name, "content": blocks,
                "stop_reason": reason, "stop_sequence": r.stop_string if reason == "stop_sequence" else None,
                "usage": usage(job.prompt_tokens, r.cached_tokens, r.completion_tokens)}

    def error_event(self, error: Exception) -> dict:
        return to_api_error(error).body("anthropic")


ROUTE = MessagesRoute()


@router.post("/v1/messages")
async def messages(request: Request):
    return await ROUTE.handle(request)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> dict[str, int]:
    """The prompt's tokens: the system prompt, messages and tools through the chat template."""
    state = server_state(request)
    req = await state.read(request, CountTokensRequest)
    state.check_model(req.model)
    chat = ChatCompletionRequest.model_validate(req.chat_fields())
    with renamed_params(_RENAMES):
        plan = await chat_tools.plan_tools(state, chat)
    ids = await render_chat(state, [m.template_dict() for m in chat.messages], tools=plan.template_tools)
    return {"input_tokens": len(ids)}
