"""OpenAI's Responses API on the request pipeline: POST /v1/responses (whole, streamed with its
typed events, or in the background), GET / DELETE /v1/responses/{id}, POST
/v1/responses/{id}/cancel, POST /v1/responses/input_tokens.

A Responses request is read as the chat request it means (`ResponsesRequest.to_chat`, after the
stored conversation `previous_response_id` names): the same chat template, tool plan, constraint
(text.format) and sampling as /v1/chat/completions, shaped as output items (reasoning from
--reasoning-parser, a message with output_text, function calls). Stored responses live in this
process's `ResponseStore` (`--responses-store-size`).
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request

from batonlm.sampling_params import SamplingParams
from batonlm.server import chat_tools
from batonlm.server.errors import APIError, bad_request, renamed_params, to_api_error
from batonlm.server.openai_common import render_chat, request_constraint, sampling_params
from batonlm.server.pipeline import ChoiceResult, Job, Route, Stream, collect_choices
from batonlm.server.protocol import ChatCompletionRequest
from batonlm.server.response_store import ResponseStore, StoredResponse
from batonlm.server.responses_protocol import InputTokensRequest, ResponsesRequest
from batonlm.server.sse import named_sse
from batonlm.server.state import ServerState, server_state
from batonlm.tokenizer_manager.request_state import GenerationChunk
from batonlm.tool_calls.parser import ToolCall

router = APIRouter()

# The chat request's field names in errors, as the Responses request names them.
_RENAMES = ((r"^tools\.(\d+)\.function\.parameters", r"tools.\1.parameters"),
            (r"^response_format(\.json_schema)?", "text.format"), (r"^max_tokens$", "max_output_tokens"),
            (r"^messages$", "input"))


def store_of(state: ServerState) -> ResponseStore:
    store = getattr(state, "_responses", None)
    if store is None:
        store = state._responses = ResponseStore(state.args.responses_store_size)  # type: ignore[attr-defined]
    return store


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class ResponsesJob(Job[ResponsesRequest]):
    chat: ChatCompletionRequest | None = None  # the chat request it means
    plan: chat_tools.ToolPlan | None = None
    history: list[dict[str, Any]] = field(default_factory=list)  # the stored conversation it continues


def reasoning_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "reasoning", "id": _id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status != "in_progress" else []
    return {"type": "message", "id": item_id or _id("msg"), "status": status, "role": "assistant", "content": content}


def call_item(call: ToolCall, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id or _id("fc"), "call_id": call.id, "name": call.name,
            "arguments": call.arguments if status == "completed" else "", "status": status}


def response_object(state: ServerState, job: ResponsesJob, status: str, output: list[dict[str, Any]],
                    result: ChoiceResult | None = None) -> dict[str, Any]:
    """The response object in `status`, with the result's usage once there is one."""
    req = job.req
    fmt = req.text.format if req.text is not None and req.text.format is not None else None
    usage = None
    if result is not None:
        usage = {"input_tokens": job.prompt_tokens, "input_tokens_details": {"cached_tokens": result.cached_tokens},
                 "output_tokens": result.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": job.prompt_tokens + result.completion_tokens}
    incomplete = status == "incomplete"
    return {
        "id": job.rid, "object": "response", "created_at": job.created, "status": status,
        "background": req.background, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "model": state.model_name, "output": output,
        "parallel_tool_calls": req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
        "previous_response_id": req.previous_response_id, "reasoning": {"effort": None, "summary": None},
        "store": req.store, "temperature": req.temperature if req.temperature is not None else 1.0,
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
        "tool_choice": (req.tool_choice.model_dump() if req.tool_choice is not None and
                        not isinstance(req.tool_choice, str) else req.tool_choice or "auto"),
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
        "top_p": req.top_p if req.top_p is not None else 1.0, "truncation": "disabled",
        "usage": usage, "metadata": req.metadata or {}, "user": req.user,
    }


def final_status(result: ChoiceResult) -> str:
    return "incomplete" if result.finish_reason == "length" else "completed"


def item_status(result: ChoiceResult) -> str:
    """The last text item's (message or reasoning): cut by max_output_tokens, it is incomplete."""
    return "incomplete" if result.finish_reason == "length" else "completed"


def conversation(job: ResponsesJob, content: str | None, calls: list[ToolCall]) -> list[dict[str, Any]]:
    """The stored conversation through this response: history, this input, the answer."""
    assert job.chat is not None
    given = [m.template_dict() for m in job.chat.messages]
    start = 1 if job.req.instructions is not None else 0  # the instructions are not carried on
    answer: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        answer["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                for c in calls]
    return [*given[start:], answer]


def input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    if isinstance(req.input, str):
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": req.input}]}]
    return [item.model_dump(exclude_none=True) for item in req.input]


class ResponsesStream(Stream[ResponsesRequest]):
    """response.created, response.in_progress; per output item output_item.added, its deltas
    (reasoning_text / output_text / function_call_arguments) and .done events, output_item.done;
    then response.completed (or .incomplete). Every event has a sequence_number; no [DONE]."""

    end = None
    job: ResponsesJob

    def __init__(self, state: ServerState, job: ResponsesJob) -> None:
        super().__init__(state, job)
        assert job.plan is not None
        self.output = chat_tools.ChoiceOutput(job.plan, state.args.reasoning_parser)
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # the finished output items
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.text = ""  # of the open item
        self.result = ChoiceResult()
        self.content = ""  # the message's text, all of it
        self.calls: list[ToolCall] = []

    def frame(self, payload: dict) -> bytes:
        payload["sequence_number"] = self.seq
        self.seq += 1
        return named_sse(payload)

    def opening(self) -> list[dict]:
        body = response_object(self.state, self.job, "in_progress", [])
        return [{"type": "response.created", "response": body}, {"type": "response.in_progress", "response": body}]

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.items)}

    def _start(self, item: dict[str, Any]) -> list[dict]:
        out = self._finish_open()
        self.open, self.text = item, ""
        out.append({"type": "response.output_item.added", "output_index": len(self.items), "item": item})
        if item["type"] == "message":
            out.append({"type": "response.content_part.added", **self._where(), "content_index": 0,
                        "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}})
        return out

    def _finish_open(self, status: str = "completed") -> list[dict]:
        item = self.open
        if item is None:
            return []
        where, text, out = self._where(), self.text, []
        if item["type"] == "reasoning":
            out.append({"type": "response.reasoning_text.done", **where, "content_index": 0, "text": text})
            done = {**item, "content": [{"type": "reasoning_text", "text": text}], "status": status}
        elif item["type"] == "message":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            out.append({"type": "response.output_text.done", **where, "content_index": 0, "text": text, "logprobs": []})
            out.append({"type": "response.content_part.done", **where, "content_index": 0, "part": part})
            done = {**item, "content": [part], "status": status}
        else:
            out.append({"type": "response.function_call_arguments.done", **where, "name": item["name"],
                        "arguments": text})
            done = {**item, "arguments": text, "status": status}
        out.append({"type": "response.output_item.done", "output_index": len(self.items), "item": done})
        self.items.append(done)
        self.open = None
        return out

    def events(self, i: int, chunk: GenerationChunk) -> list[dict]:
        r = self.result
        r.completion_tokens = chunk.completion_tokens
        if chunk.cached_tokens is not None:
            r.cached_tokens = chunk.cached_tokens
        last = chunk.finish_reason is not None
        reasoning, text, deltas, calls = self.output.feed(chunk.text, last)
        out: list[dict] = []
        if reasoning:
            if self.open is None or self.open["type"] != "reasoning":
                out += self._start(reasoning_item("", "in_progress"))
            self.text += reasoning
            out.append({"type": "response.reasoning_text.delta", **self._where(), "content_index": 0,
                        "delta": reasoning})
        if text:
            if self.open is None or self.open["type"] != "message":
                out += self._start(message_item("", "in_progress"))
            self.text += text
            self.content += text
            out.append({"type": "response.output_text.delta", **self._where(), "content_index": 0, "delta": text,
                        "logprobs": []})
        for d in deltas:  # a call's item opens with its name; its arguments follow as they are written
            if d.name is not None:
                out += self._start(call_item(ToolCall(d.name, "", d.id), "in_progress"))
            if d.arguments:
                self.text += d.arguments
                out.append({"type": "response.function_call_arguments.delta", **self._where(), "delta": d.arguments})
        if last:
            r.finish_reason = chunk.finish_reason
            # A message or reasoning cut short is incomplete, and so is a call the end did not complete.
            whole = {c.id for c in calls}
            cut = self.open is not None and (self.open["type"] != "function_call" or self.open["call_id"] not in whole)
            out += self._finish_open(item_status(r) if cut else "completed")
            self.calls = calls
        return out

    def closing(self) -> list[dict]:
        job, r = self.job, self.result
        status = final_status(r)
        body = response_object(self.state, job, status, self.items, r)
        if job.req.store:
            store_of(self.state).put(job.rid, StoredResponse(
                body, conversation(job, self.content or None, self.calls), input_items(job.req)))
        return [{"type": f"response.{status}", "response": body}]


class ResponsesRoute(Route[ResponsesRequest]):
    request_model = ResponsesRequest
    id_prefix = "resp"
    prompt_param = "input"
    size_params = ("max_output_tokens", "max_output_tokens")
    stream_type = ResponsesStream
    job_type = ResponsesJob
    # Its hooks take a ResponsesJob (job_type makes it), narrower than Route's Job: hence the override ignores.

    def request_id(self, req: ResponsesRequest) -> str:
        return _id("resp")

    async def handle(self, request: Request) -> Any:
        state = server_state(request)
        req = await state.read(request, ResponsesRequest)
        if not req.background:
            return await self.handle_parsed(request, state, req)
        state.check_model(req.model)
        state.check_healthy()
        job: ResponsesJob = await self.prepare(state, req)  # type: ignore[assignment]
        store = store_of(state)
        queued = response_object(state, job, "queued", [])
        entry = StoredResponse(queued, input_items=input_items(req))
        entry.task = asyncio.create_task(self._background(state, job, entry))
        store.put(job.rid, entry)
        return queued

    async def _background(self, state: ServerState, job: ResponsesJob, entry: StoredResponse) -> None:
        entry.body = {**entry.body, "status": "in_progress"}
        try:
            results = await collect_choices(state, job, self.size_param(job))
            entry.body = self.answer(state, job, results)  # stored there, with its conversation
        except asyncio.CancelledError:
            entry.body = {**entry.body, "status": "cancelled"}
        except Exception as e:
            error = to_api_error(e)
            entry.body = {**entry.body, "status": "failed", "error": {"code": error.code or "server_error",
                                                                     "message": error.message}}
        finally:
            entry.task = None

    def check(self, state: ServerState, job: ResponsesJob) -> None:  # type: ignore[override]
        prev = job.req.previous_response_id
        if prev is not None:
            stored = store_of(state).get(prev)
            if stored is None:
                raise APIError(404, f"Previous response with id '{prev}' not found (responses are kept in this "
                               "server process's memory, --responses-store-size).", param="previous_response_id",
                               code="previous_response_not_found")
            if stored.body["status"] in ("queued", "in_progress"):
                raise bad_request(f"Previous response with id '{prev}' has not finished", param="previous_response_id")
            job.history = stored.messages
        with renamed_params(_RENAMES):
            job.chat = job.req.to_chat(job.history)

    async def constrain(self, state: ServerState, job: ResponsesJob) -> None:  # type: ignore[override]
        assert job.chat is not None
        with renamed_params(_RENAMES):
            job.constraint = await request_constraint(job.chat, state.args.max_constraint_bytes)
            job.plan = await chat_tools.plan_tools(state, job.chat)
        job.constraint = job.plan.constraint or job.constraint
        job.make_stop = job.plan.make_stop
        job.skip_special_tokens = job.plan.skip_special_tokens

    async def prompts(self, state: ServerState, job: ResponsesJob) -> list[list[int]]:  # type: ignore[override]
        assert job.chat is not None and job.plan is not None
        with renamed_params(_RENAMES):
            return [await render_chat(state, [m.template_dict() for m in job.chat.messages],
                                      tools=job.plan.template_tools)]

    def sampling_params(self, state: ServerState, job: ResponsesJob,  # type: ignore[override]
                        prompt_ids: list[int]) -> list[SamplingParams]:
        assert job.chat is not None
        with renamed_params(_RENAMES):
            return sampling_params(state, job.chat, len(prompt_ids), self.prompt_param, job.constraint)

    def answer(self, state: ServerState, job: ResponsesJob, results: list[ChoiceResult]) -> dict:  # type: ignore[override]
        assert job.plan is not None
        (r,) = results
        reasoning, content, calls = chat_tools.whole_output(job.plan, state.args.reasoning_parser, r.text)
        output = ([reasoning_item(reasoning)] if reasoning else []) + ([message_item(content)] if content else [])
        output += [call_item(c) for c in calls]
        if output and output[-1]["type"] != "function_call":  # a parsed call is whole
            output[-1]["status"] = item_status(r)
        body = response_object(state, job, final_status(r), output, r)
        if job.req.store:
            store_of(state).put(job.rid, StoredResponse(body, conversation(job, content, calls), input_items(job.req)))
        return body

    def error_event(self, error: Exception) -> dict:
        e = to_api_error(error)
        return {"type": "error", "code": e.code, "message": e.message, "param": e.param}


ROUTE = ResponsesRoute()


@router.post("/v1/responses")
async def create_response(request: Request):
    return await ROUTE.handle(request)


@router.post("/v1/responses/input_tokens")
async def input_tokens(request: Request) -> dict[str, Any]:
    """The prompt's tokens: instructions, the stored conversation, the input and tools through
    the chat template."""
    state = server_state(request)
    req = await state.read(request, InputTokensRequest)
    state.check_model(req.model)
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        stored = store_of(state).get(req.previous_response_id)
        if stored is None:
            raise APIError(404, f"Previous response with id '{req.previous_response_id}' not found.",
                           param="previous_response_id", code="previous_response_not_found")
        history = stored.messages
    with renamed_params(_RENAMES):
        chat = ChatCompletionRequest.model_validate(req.chat_fields(history))
        plan = await chat_tools.plan_tools(state, chat)
        ids = await render_chat(state, [m.template_dict() for m in chat.messages], tools=plan.template_tools)
    return {"object": "response.input_tokens", "input_tokens": len(ids)}


def _stored(request: Request, response_id: str) -> StoredResponse:
    entry = store_of(server_state(request)).get(response_id)
    if entry is None:
        raise APIError(404, f"No response with id '{response_id}' found (responses are kept in this server "
                       "process's memory, --responses-store-size).", type="not_found_error", code="response_not_found")
    return entry


@router.get("/v1/responses/{response_id}")
async def get_response(request: Request, response_id: str) -> dict[str, Any]:
    return _stored(request, response_id).body


@router.get("/v1/responses/{response_id}/input_items")
async def get_input_items(request: Request, response_id: str) -> dict[str, Any]:
    items = _stored(request, response_id).input_items
    return {"object": "list", "data": items, "first_id": None, "last_id": None, "has_more": False}


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str) -> dict[str, Any]:
    _stored(request, response_id)
    store_of(server_state(request)).delete(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(request: Request, response_id: str) -> dict[str, Any]:
    """Cancel a background response (its generation is aborted); others are refused (400)."""
    entry = _stored(request, response_id)
    if not entry.body.get("background"):
        raise bad_request("Only background responses can be cancelled.", param="response_id")
    if entry.task is not None:
        entry.task.cancel()
        try:
            await entry.task
        except asyncio.CancelledError:
            pass
    return entry.body
