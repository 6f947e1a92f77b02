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
from typing import Any

from fastapi import APIRouter, Request

from batonlm.sampling_params import SamplingParams
from batonlm.server import chat_tools
from batonlm.server.errors import APIError, bad_request, renamed_params, to_api_error
from batonlm.server.openai_common import constraint_field, render_chat, request_constraint, sampling_params
from batonlm.server.pipeline import ChoiceResult, Route, collect_choices
from batonlm.server.protocol import ChatCompletionRequest
from batonlm.server.response_store import StoredResponse
from batonlm.server.responses_items import (
    ResponsesJob,
    call_item,
    conversation,
    final_status,
    input_items,
    item_status,
    message_item,
    new_id,
    reasoning_item,
    response_object,
    store_of,
)
from batonlm.server.responses_protocol import InputTokensRequest, ResponsesRequest
from batonlm.server.responses_stream import ResponsesStream
from batonlm.server.state import ServerState, server_state

router = APIRouter()

# The chat request's field names in errors, as the Responses request names them.
_RENAMES = ((r"^tools\.(\d+)\.function\.parameters", r"tools.\1.parameters"),
            (r"^response_format(\.json_schema)?", "text.format"), (r"^max_tokens$", "max_output_tokens"),
            (r"^messages$", "input"))


class ResponsesRoute(Route[ResponsesRequest]):
    request_model = ResponsesRequest
    id_prefix = "resp"
    prompt_param = "input"
    size_params = ("max_output_tokens", "max_output_tokens")
    stream_type = ResponsesStream
    job_type = ResponsesJob
    # Its hooks take a ResponsesJob (job_type makes it), narrower than Route's Job: hence the override ignores.

    def request_id(self, req: ResponsesRequest) -> str:
        return new_id("resp")

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
        job.constraint_param = constraint_field(job.chat, bool(job.plan.constraint), _RENAMES)
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
