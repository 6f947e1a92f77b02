"""POST /v1/completions (prompt: a string, a list of strings, token ids, or lists of token ids).

With `echo` the prompt comes back before the completion, and with `logprobs` too, its tokens'
logprobs (the first token's null: nothing precedes it); `max_tokens: 0` (with `echo` only)
scores the prompt without completing it: the prefill runs, its one sampled token is dropped.
"""

from __future__ import annotations

import time

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from batonlm.server import logprobs
from batonlm.server import openai_common as common
from batonlm.server.errors import bad_request
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
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens 0 is allowed only with echo (to score the prompt)", param="max_tokens")
    num_prompts = _num_prompts(req.prompt)
    common.check_limits(state, req)
    constraint = await common.request_constraint(req)
    state.manager.admit(num_prompts * req.n)
    prompts = await _prompts(state, req.prompt)
    prompt_only = req.max_tokens == 0
    scored = {"prompt_logprobs": req.logprobs} if req.echo and req.logprobs is not None else {}
    jobs = []
    for ids in prompts:
        params = common.sampling_params(state, req, len(ids), req.num_logprobs, "prompt", constraint)
        if prompt_only or scored:
            params = [msgspec.structs.replace(p, **scored, **({"max_new_tokens": 1} if prompt_only else {}))
                      for p in params]
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
    if prompt_only:
        results = [_unscored(r) for r in results]
    return JSONResponse({
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": state.model_name,
        "choices": [
            {
                "index": i,
                "text": echoes[i] + r.text,
                "logprobs": None if req.logprobs is None else
                logprobs.completion_logprobs(state, (r.prompt_logprobs or []) + r.logprobs, 0),
                "finish_reason": r.finish_reason,
            }
            for i, r in enumerate(results)
        ],
        "usage": common.usage(prompt_tokens, sum(r.completion_tokens for r in results),
                              [r.cached_tokens for r in results], req.n),
    })


def _unscored(r: common.ChoiceResult) -> common.ChoiceResult:
    """A max_tokens 0 choice: the prompt alone (its one sampled token dropped)."""
    return common.ChoiceResult(prompt_logprobs=r.prompt_logprobs, finish_reason="length",
                               cached_tokens=r.cached_tokens)


def _stream(state: ServerState, req: CompletionRequest, jobs, echoes: list[str], rid: str, created: int,
            prompt_tokens: int):
    """Each choice's first event carries its echo (and the prompt's logprobs, which come with
    the first token); a max_tokens 0 choice then ends without a token."""
    prompt_only = req.max_tokens == 0
    offsets = [0] * len(jobs)
    opened = [False] * len(jobs)

    def to_choices(i: int, c) -> list[dict]:
        text, items = ("", []) if prompt_only else (c.text, c.logprobs or [])
        if not opened[i] and (c.token_ids or c.finish_reason is not None):
            opened[i] = True
            text = echoes[i] + text
            if c.prompt_logprobs is not None:
                items = logprobs.prompt_token_logprobs(*jobs[i], c) + items
        out = []
        if text or (req.logprobs is not None and items):
            lp = logprobs.completion_logprobs(state, items, offsets[i]) if req.logprobs is not None else None
            offsets[i] += len(text)
            out.append({"index": i, "text": text, "logprobs": lp, "finish_reason": None})
        if c.finish_reason is not None:
            out.append({"index": i, "text": "", "logprobs": None,
                        "finish_reason": "length" if prompt_only else c.finish_reason})
        return out

    return common.sse_body(
        state, jobs, req.stop_strings, rid, obj="text_completion", created=created, include_usage=req.include_usage,
        prompt_tokens=prompt_tokens, choices_per_prompt=req.n, opening=[], to_choices=to_choices,
        count_completion=not prompt_only,
    )
