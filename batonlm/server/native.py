"""Health, models, metrics, and the native POST /generate."""

from __future__ import annotations

import time

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from batonlm.sampling_params import InvalidSamplingParams, SamplingParams
from batonlm.server import limits, logprobs
from batonlm.server import openai_common as common
from batonlm.server.errors import bad_request, model_not_found, to_api_error
from batonlm.server.protocol import NativeGenerateRequest
from batonlm.server.sse import DONE, sse
from batonlm.server.state import ServerState, server_state, until_disconnected

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    state = server_state(request)
    if not state.manager.healthy:
        return JSONResponse({"status": "unhealthy", "reason": "the scheduler is not running"}, status_code=503)
    if state.manager.draining:
        return JSONResponse({"status": "shutting_down", "reason": "the server is shutting down"}, status_code=503)
    return {"status": "ok"}


def _model_card(state: ServerState) -> dict:
    info = state.manager.info
    return {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "batonlm",
        "root": info.model_path if info else state.args.model,
        "max_model_len": info.context_length if info else None,
    }


@router.get("/v1/models")
async def list_models(request: Request):
    return {"object": "list", "data": [_model_card(server_state(request))]}


@router.get("/v1/models/{model:path}")
async def get_model(request: Request, model: str):
    state = server_state(request)
    if model != state.model_name:
        raise model_not_found(model)
    return _model_card(state)


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request):
    state = server_state(request)
    if state.manager.healthy:
        try:
            state.metrics.update(await state.manager.get_stats(timeout_s=5.0))
        except Exception:  # a dying scheduler: report what we have
            pass
    return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


@router.post("/flush_cache")
async def flush_cache(request: Request):
    """Empty the prefix cache; a 400 while requests run or wait."""
    state = server_state(request)
    state.check_healthy()
    result = await state.manager.flush_cache()
    if not result.ok:
        raise bad_request(f"the cache cannot be flushed now: {result.message}", code="requests_running")
    return {"status": "ok"}


@router.post("/generate")
async def generate(request: Request):
    """SGLang-style: `text` or `input_ids`, `sampling_params` (SGLang names, plus `stop`
    strings), `stream`, and the logprob fields (`return_logprob`, `logprob_start_len`: -1 no
    prompt logprobs, `top_logprobs_num`, `return_text_in_logprobs`). Returns `text`,
    `output_ids` and `meta_info` (with `input/output_token_logprobs` [logprob, id, text] and
    `input/output_top_logprobs` when asked; streamed, each event has its own tokens')."""
    state = server_state(request)
    req = await state.read(request, NativeGenerateRequest)
    state.check_healthy()
    raw = dict(req.sampling_params or {})
    stop = raw.pop("stop", None) or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad_request("stop must be a string or a list of strings", param="sampling_params.stop")
    if not all(stop):
        raise bad_request("stop strings must not be empty", param="sampling_params.stop")
    try:
        params = SamplingParams.from_dict(raw)
    except InvalidSamplingParams as e:
        raise e.nested("sampling_params") from None
    limits.check_limits(state.args, {**msgspec.structs.asdict(params), "stop": stop}, prefix="sampling_params.")
    limits.check_limits(state.args, {"top_logprobs_num": req.top_logprobs_num})
    if req.return_logprob:
        k = req.top_logprobs_num
        scored = {"prompt_logprobs": k, "logprob_start_len": req.logprob_start_len} if req.logprob_start_len >= 0 else {}
        params = msgspec.structs.replace(params, logprobs=k, **scored)
    if params.constraint is not None:
        kind, text = params.constraint
        await common.check_constraint_param(kind, text, f"sampling_params.{kind}")
    state.manager.admit(1)
    ids = await state.manager.tokenize_async(req.text) if req.text is not None else list(req.input_ids or [])
    if req.return_logprob and req.logprob_start_len > len(ids):
        raise bad_request(f"logprob_start_len must be at most the prompt's length ({len(ids)} tokens), got "
                          f"{req.logprob_start_len}", param="logprob_start_len")
    try:
        state.manager.validate_prompt(ids, params, "text" if req.text is not None else "input_ids")
    except InvalidSamplingParams as e:
        raise e.nested("sampling_params") from None
    rid = req.rid or common.request_id("gen")
    jobs = [(ids, params)]

    # The logprob lists meta_info carries (with top alternatives when k > 0): output ones when
    # asked; input ones when asked, and with return_logprob always (empty for logprob_start_len -1).
    k_out = params.logprobs
    k_in = params.prompt_logprobs if params.prompt_logprobs is not None or not req.return_logprob else k_out

    def meta(finish: str | None, completion_tokens: int, cached_tokens: int | None, output_lp=None,
             prompt_lp=None, spec=None) -> dict:
        out = {"id": rid, "finish_reason": finish, "prompt_tokens": len(ids), "completion_tokens": completion_tokens,
               "cached_tokens": cached_tokens}
        if spec is not None:  # speculative decoding: SGLang's names
            out["spec_verify_ct"], out["spec_accepted_drafts"] = spec
            out["spec_accept_length"] = (spec[0] + spec[1]) / spec[0]
        for name, items, k in (("input", prompt_lp, k_in), ("output", output_lp, k_out)):
            if k is not None:
                tokens, tops = logprobs.generate_logprobs(state, items or [], req.return_text_in_logprobs)
                out[f"{name}_token_logprobs"] = tokens
                if k:
                    out[f"{name}_top_logprobs"] = tops
        return out

    if req.stream:
        async def stream():
            try:
                cached = None
                async for _, c in common.stream_choices(state, jobs, stop, rid):
                    cached = c.cached_tokens if c.cached_tokens is not None else cached
                    prompt_lp = None if c.prompt_logprobs is None else logprobs.prompt_token_logprobs(ids, params, c)
                    yield sse({"text": c.text, "output_ids": c.token_ids,
                               "meta_info": meta(c.finish_reason, c.completion_tokens, cached, c.logprobs, prompt_lp,
                                                 c.spec)})
            except Exception as e:
                yield sse(to_api_error(e).body())
            yield DONE

        return StreamingResponse(stream(), media_type="text/event-stream")
    t0 = time.perf_counter()
    (result,) = await until_disconnected(request, common.collect_choices(state, jobs, stop, rid))
    return {
        "text": result.text,
        "output_ids": result.token_ids,
        "meta_info": {**meta(result.finish_reason, result.completion_tokens, result.cached_tokens, result.logprobs,
                             result.prompt_logprobs, result.spec),
                      "e2e_latency": time.perf_counter() - t0},
    }
