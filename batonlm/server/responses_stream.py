"""A streamed Responses answer: its typed events with sequence numbers (response.created, ...,
per output item its added / delta / done events, response.completed or .incomplete), an item
opened when its first text or call comes; a stored response is kept when it ends."""

from __future__ import annotations

from typing import Any

from batonlm.server import chat_tools
from batonlm.server.pipeline import ChoiceResult, Stream
from batonlm.server.response_store import StoredResponse
from batonlm.server.responses_items import (
    ResponsesJob,
    call_item,
    conversation,
    final_status,
    input_items,
    item_status,
    message_item,
    reasoning_item,
    response_object,
    store_of,
)
from batonlm.server.responses_protocol import ResponsesRequest
from batonlm.server.sse import named_sse
from batonlm.server.state import ServerState
from batonlm.tokenizer_manager.request_state import GenerationChunk
from batonlm.tool_calls.parser import ToolCall


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
