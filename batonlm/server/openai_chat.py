"""POST /v1/chat/completions."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from batonlm.server import chat_tools, logprobs
from batonlm.server import openai_common as common
from batonlm.server.protocol import ChatCompletionRequest
from batonlm.server.reasoning import ReasoningStream, split_reasoning
from batonlm.server.state import ServerState, server_state, until_disconnected

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    state = server_state(request)
    req = await state.read(request, ChatCompletionRequest)
    state.check_model(req.model)
    state.check_healthy()
    common.check_limits(state, req)
    constraint = await common.request_constraint(req)
    plan = await chat_tools.plan_tools(state, req)
    state.manager.admit(req.n)
    messages = [m.template_dict() for m in req.messages]
    input_ids = await common.render_chat(state, messages, tools=plan.template_tools)
    params = common.sampling_params(state, req, len(input_ids), req.num_logprobs, "messages",
                                   plan.constraint or constraint)
    state.manager.validate_prompt(input_ids, params[0], "messages")
    jobs = [(input_ids, p) for p in params]
    rid = common.request_id("chatcmpl")
    created = int(time.time())
    if req.stream:
        return StreamingResponse(
            _stream(state, req, plan, jobs, rid, created, len(input_ids)), media_type="text/event-stream"
        )
    results = await until_disconnected(request, common.collect_choices(state, jobs, req.stop_strings, rid))
    kind = state.args.reasoning_parser
    split = [split_reasoning(kind, r.text) if kind != "none" else (None, r.text) for r in results]
    parsed = [plan.parse(text) for _, text in split]
    return JSONResponse({
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": state.model_name,
        "choices": [
            {
                "index": i,
                "message": chat_tools.message(content, calls, reasoning),
                "logprobs": logprobs.chat_logprobs(state, r.logprobs) if req.logprobs else None,
                "finish_reason": chat_tools.finish_reason(r.finish_reason, calls),
            }
            for i, (r, (content, calls), (reasoning, _)) in enumerate(zip(results, parsed, split))
        ],
        "usage": common.usage(len(input_ids), sum(r.completion_tokens for r in results),
                              [r.cached_tokens for r in results], req.n),
    })


def _stream(state: ServerState, req: ChatCompletionRequest, plan: chat_tools.ToolPlan, jobs, rid: str, created: int,
            prompt_tokens: int):
    streams = [plan.streamer() for _ in jobs]
    kind = state.args.reasoning_parser
    thinking = [ReasoningStream(kind) if kind != "none" else None for _ in jobs]

    def split(i: int, text: str, last: bool) -> tuple[str, str]:
        if thinking[i] is None:
            return "", text
        r, t = thinking[i].feed(text)
        if last:
            r2, t2 = thinking[i].finish()
            r, t = r + r2, t + t2
        return r, t

    def to_choices(i: int, c) -> list[dict]:
        out = []
        reasoning, text = split(i, c.text, c.finish_reason is not None)
        text = streams[i].feed(text)
        if reasoning:
            out.append({"index": i, "delta": {"reasoning_content": reasoning}, "logprobs": None, "finish_reason": None})
        if text or (req.logprobs and c.logprobs):
            lp = logprobs.chat_logprobs(state, c.logprobs or []) if req.logprobs else None
            out.append({"index": i, "delta": {"content": text}, "logprobs": lp, "finish_reason": None})
        if c.finish_reason is not None:
            rest, calls = streams[i].finish()
            if rest:
                out.append({"index": i, "delta": {"content": rest}, "logprobs": None, "finish_reason": None})
            if calls:
                deltas = [call.to_openai(index=k) for k, call in enumerate(calls)]
                out.append({"index": i, "delta": {"tool_calls": deltas}, "logprobs": None, "finish_reason": None})
            out.append({"index": i, "delta": {}, "logprobs": None,
                        "finish_reason": chat_tools.finish_reason(c.finish_reason, calls)})
        return out

    opening = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
               for i in range(len(jobs))]
    return common.sse_body(
        state, jobs, req.stop_strings, rid, obj="chat.completion.chunk", created=created, include_usage=req.include_usage,
        prompt_tokens=prompt_tokens, choices_per_prompt=req.n, opening=opening, to_choices=to_choices,
    )
