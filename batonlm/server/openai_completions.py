"""POST /v1/completions (prompt: a string, a list of strings, token ids, or lists of token ids)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from batonlm.server import openai_common as common
from batonlm.server.protocol import CompletionRequest
from batonlm.server.state import ServerState, server_state, until_disconnected

router = APIRouter()


def _num_prompts(prompt) -> int:
    return 1 if isinstance(prompt, str) or all(isinstance(p, int) for p in prompt) else len(prompt)


async def _prompts(state: ServerState, prompt) -> list[list[int]]:
    if isinstance(prompt, str):
        return [await state.manager.tokenize_async(prompt)]
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return [await state.manager.tokenize_async(p) if isinstance(p, str) else list(p) for p in prompt]


@router.post("/v1/completions")
async def completions(request: Request):
    state = server_state(request)
    req = await state.read(request, CompletionRequest)
    state.check_model(req.model)
    state.check_healthy()
    num_prompts = _num_prompts(req.prompt)
    common.check_limits(state, req, num_prompts=num_prompts, prompt_param="prompt")
    constraint = await common.request_constraint(req)
    state.manager.admit(num_prompts * req.n)
    prompts = await _prompts(state, req.prompt)
    jobs = []
    for ids in prompts:
        params = common.sampling_params(state, req, len(ids), req.num_logprobs, "prompt", constraint)
        state.manager.validate_prompt(ids, params[0], "prompt")
        jobs += [(ids, p) for p in params]
    echoes = [state.tokenizer.decode(ids, skip_special_tokens=True) if req.echo else "" for ids, _ in jobs]
    rid = common.request_id("cmpl")
    created = int(time.time())
    prompt_tokens = sum(len(ids) for ids in prompts)
    if req.stream:
        return StreamingResponse(_stream(state, req, jobs, echoes, rid, created, prompt_tokens),
                                 media_type="text/event-stream")
    results = await until_disconnected(request, common.collect_choices(state, jobs, req.stop_strings, rid))
    return JSONResponse({
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": state.model_name,
        "choices": [
            {
                "index": i,
                "text": echoes[i] + r.text,
                "logprobs": common.completion_logprobs(state, r.logprobs, 0) if req.logprobs is not None else None,
                "finish_reason": r.finish_reason,
            }
            for i, r in enumerate(results)
        ],
        "usage": common.usage(prompt_tokens, sum(r.completion_tokens for r in results),
                              [r.cached_tokens for r in results], req.n),
    })


def _stream(state: ServerState, req: CompletionRequest, jobs, echoes: list[str], rid: str, created: int,
            prompt_tokens: int):
    offsets = [len(e) for e in echoes]

    def to_choices(i: int, c) -> list[dict]:
        out = []
        if c.text or (req.logprobs is not None and c.logprobs):
            lp = common.completion_logprobs(state, c.logprobs or [], offsets[i]) if req.logprobs is not None else None
            offsets[i] += len(c.text)
            out.append({"index": i, "text": c.text, "logprobs": lp, "finish_reason": None})
        if c.finish_reason is not None:
            out.append({"index": i, "text": "", "logprobs": None, "finish_reason": c.finish_reason})
        return out

    opening = [{"index": i, "text": e, "logprobs": None, "finish_reason": None} for i, e in enumerate(echoes) if e]
    return common.sse_body(
        state, jobs, req.stop_strings, rid, obj="text_completion", created=created, include_usage=req.include_usage,
        prompt_tokens=prompt_tokens, choices_per_prompt=req.n, opening=opening, to_choices=to_choices,
    )
