"""The Responses API's shapes: a job, output items (reasoning, message, function call), the
response object and its status, and what a stored response keeps (its conversation, its input
items)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from batonlm.server import chat_tools
from batonlm.server.pipeline import ChoiceResult, Job
from batonlm.server.protocol import ChatCompletionRequest
from batonlm.server.response_store import ResponseStore
from batonlm.server.responses_protocol import ResponsesRequest
from batonlm.server.state import ServerState
from batonlm.tool_calls.parser import ToolCall


def store_of(state: ServerState) -> ResponseStore:
    store = getattr(state, "_responses", None)
    if store is None:
        store = state._responses = ResponseStore(state.args.responses_store_size)  # type: ignore[attr-defined]
    return store


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class ResponsesJob(Job[ResponsesRequest]):
    chat: ChatCompletionRequest | None = None  # the chat request it means
    plan: chat_tools.ToolPlan | None = None
    history: list[dict[str, Any]] = field(default_factory=list)  # the stored conversation it continues


def reasoning_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "reasoning", "id": new_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status != "in_progress" else []
    return {"type": "message", "id": item_id or new_id("msg"), "status": status, "role": "assistant", "content": content}


def call_item(call: ToolCall, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id or new_id("fc"), "call_id": call.id, "name": call.name,
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
