"""POST /v1/chat/completions on the request pipeline: messages through the chat template, tools
(chat_tools.py), reasoning (reasoning.py), and OpenAI's chat answer and chunks."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import APIRouter, Request

from batonlm.server import chat_tools, logprobs
from batonlm.server.openai_common import OpenAIRoute, OpenAIStream, constraint_field, render_chat
from batonlm.server.pipeline import ChoiceResult, Job
from batonlm.server.protocol import ChatCompletionRequest
from batonlm.server.reasoning import ReasoningStream, split_reasoning
from batonlm.server.state import ServerState
from batonlm.tokenizer_manager.request_state import GenerationChunk
from batonlm.tool_calls.streaming import CallDelta

router = APIRouter()


@dataclass
class ChatJob(Job[ChatCompletionRequest]):
    plan: chat_tools.ToolPlan | None = None


class ChatStream(OpenAIStream[ChatCompletionRequest]):
    object_name = "chat.completion.chunk"
    job: ChatJob

    def __init__(self, state: ServerState, job: ChatJob) -> None:
        super().__init__(state, job)
        assert job.plan is not None
        self.calls = [job.plan.streamer() for _ in job.choices]
        kind = state.args.reasoning_parser
        self.thinking = [ReasoningStream(kind) if kind != "none" else None for _ in job.choices]

    def opening(self) -> list[dict]:
        return [self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}]) for i in range(len(self.job.choices))]

    def _split(self, i: int, text: str, last: bool) -> tuple[str, str]:
        """(reasoning, content) of a text delta."""
        thinking = self.thinking[i]
        if thinking is None:
            return "", text
        reasoning, content = thinking.feed(text)
        if last:
            r2, c2 = thinking.finish()
            reasoning, content = reasoning + r2, content + c2
        return reasoning, content

    def choice_deltas(self, i: int, c: GenerationChunk) -> list[dict]:
        req = self.job.req
        out = []
        reasoning, text = self._split(i, c.text, c.finish_reason is not None)
        text, deltas = self.calls[i].feed(text)
        if reasoning:
            out.append({"index": i, "delta": {"reasoning_content": reasoning}, "logprobs": None, "finish_reason": None})
        if text or (req.logprobs and c.logprobs):
            lp = logprobs.chat_logprobs(self.state, c.logprobs or []) if req.logprobs else None
            out.append({"index": i, "delta": {"content": text}, "logprobs": lp, "finish_reason": None})
        out += self._call_deltas(i, deltas)
        if c.finish_reason is not None:
            rest, calls, deltas = self.calls[i].finish()
            if rest:
                out.append({"index": i, "delta": {"content": rest}, "logprobs": None, "finish_reason": None})
            out += self._call_deltas(i, deltas)
            out.append({"index": i, "delta": {}, "logprobs": None,
                        "finish_reason": chat_tools.finish_reason(c.finish_reason, calls)})
        return out

    @staticmethod
    def _call_deltas(i: int, deltas: list[CallDelta]) -> list[dict]:
        """OpenAI's delta.tool_calls: a call's first delta with its id, type and name, then its
        arguments' text."""
        if not deltas:
            return []
        tool_calls = [{"index": d.index, "id": d.id, "type": "function", "function": {"name": d.name,
                                                                                     "arguments": d.arguments}}
                      if d.name is not None else {"index": d.index, "function": {"arguments": d.arguments}}
                      for d in deltas]
        return [{"index": i, "delta": {"tool_calls": tool_calls}, "logprobs": None, "finish_reason": None}]


class ChatRoute(OpenAIRoute[ChatCompletionRequest]):
    request_model = ChatCompletionRequest
    id_prefix = "chatcmpl"
    prompt_param = "messages"
    size_params = ("top_logprobs", "max_tokens")
    object_name = "chat.completion"
    stream_type = ChatStream
    job_type = ChatJob
    # Its hooks take a ChatJob (job_type makes it), narrower than Route's Job: hence the override ignores.

    async def constrain(self, state: ServerState, job: ChatJob) -> None:  # type: ignore[override]
        await super().constrain(state, job)
        job.plan = await chat_tools.plan_tools(state, job.req)
        job.constraint = job.plan.constraint or job.constraint  # forced tool calls: their schema
        job.constraint_param = constraint_field(job.req, bool(job.plan.constraint))
        job.make_stop = job.plan.make_stop
        job.skip_special_tokens = job.plan.skip_special_tokens

    async def prompts(self, state: ServerState, job: ChatJob) -> list[list[int]]:  # type: ignore[override]
        assert job.plan is not None
        messages = [m.template_dict() for m in job.req.messages]
        return [await render_chat(state, messages, tools=job.plan.template_tools)]

    def choices(self, state: ServerState, job: ChatJob, results: list[ChoiceResult]) -> list[dict]:  # type: ignore[override]
        assert job.plan is not None
        kind = state.args.reasoning_parser
        split = [split_reasoning(kind, r.text) if kind != "none" else (None, r.text) for r in results]
        parsed = [job.plan.parse(text) for _, text in split]
        return [
            {
                "index": i,
                "message": chat_tools.message(content, calls, reasoning),
                "logprobs": logprobs.chat_logprobs(state, r.logprobs) if job.req.logprobs else None,
                "finish_reason": chat_tools.finish_reason(r.finish_reason, calls),
            }
            for i, (r, (content, calls), (reasoning, _)) in enumerate(zip(results, parsed, split))
        ]


ROUTE = ChatRoute()


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    return await ROUTE.handle(request)
