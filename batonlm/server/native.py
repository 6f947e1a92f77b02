"""Health, models, metrics, and the native POST /generate (on the request pipeline)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from batonlm.sampling_params import InvalidSamplingParams, SamplingParams
from batonlm.server import limits, logprobs
from batonlm.server import openai_common as common
from batonlm.server.errors import bad_request
from batonlm.server.pipeline import ChoiceResult, Job, Route, Stream
from batonlm.server.protocol import NativeGenerateRequest
from batonlm.server.state import ServerState, server_state
from batonlm.tokenizer_manager.request_state import GenerationChunk

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    state = server_state(request)
    if not state.manager.healthy:
        return JSONResponse({"status": "unhealthy", "reason": "the scheduler is not running"}, status_code=503)
    if state.manager.draining:
        return JSONResponse({"status": "shutting_down", "reason": "the server is shutting down"}, status_code=503)
    return {"status": "ok"}


def _model_card(state: ServerState, adapter: str | None = None) -> dict:
    """The served model's card, or a LoRA adapter's (its `parent` the served model)."""
    info = state.manager.info
    card = {
        "id": adapter or state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "batonlm",
        "root": adapter or state.model_name,  # not the server's filesystem path
        "max_model_len": info.context_length if info else None,
    }
    return {**card, "parent": state.model_name} if adapter else card


@router.get("/v1/models")
async def list_models(request: Request):
    state = server_state(request)
    return {"object": "list", "data": [_model_card(state), *(_model_card(state, a) for a in state.adapters.by_name)]}


@router.get("/v1/models/{model:path}")
async def get_model(request: Request, model: str):
    state = server_state(request)
    return _model_card(state, model if state.lora_adapter(model) else None)


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


@dataclass
class GenerateJob(Job[NativeGenerateRequest]):
    params: SamplingParams | None = None  # the request's one sampling record
    k_in: int | None = None  # top alternatives of the input / output logprob lists meta_info carries
    k_out: int | None = None

    @property
    def batched(self) -> bool:
        """Several prompts or choices: the answer is a list, each streamed event names its `index`."""
        return self.req.batched or self.n > 1

    def meta(self, state: ServerState, i: int, finish: str | None, completion_tokens: int, cached_tokens: int | None,
             output_lp=None, prompt_lp=None, spec=None, preemptions: int = 0) -> dict:
        """Choice i's meta_info."""
        req = self.req
        out: dict[str, Any] = {"id": f"{self.rid}-{i}" if self.batched else self.rid, "finish_reason": finish,
                               "prompt_tokens": len(self.choices[i][0]), "completion_tokens": completion_tokens,
                               "cached_tokens": cached_tokens, "preemptions": preemptions}
        if spec is not None:  # speculative decoding: SGLang's names
            out["spec_verify_ct"], out["spec_accepted_drafts"] = spec
            out["spec_accept_length"] = (spec[0] + spec[1]) / spec[0]
        for name, items, k in (("input", prompt_lp, self.k_in), ("output", output_lp, self.k_out)):
            if k is not None:
                tokens, tops = logprobs.generate_logprobs(state, items or [], req.return_text_in_logprobs)
                out[f"{name}_token_logprobs"] = tokens
                if k:
                    out[f"{name}_top_logprobs"] = tops
        return out


class GenerateStream(Stream[NativeGenerateRequest]):
    job: GenerateJob

    def __init__(self, state: ServerState, job: GenerateJob) -> None:
        super().__init__(state, job)
        self.cached: list[int | None] = [None] * len(job.choices)

    def events(self, i: int, c: GenerationChunk) -> list[dict]:
        self.cached[i] = c.cached_tokens if c.cached_tokens is not None else self.cached[i]
        ids, params = self.job.choices[i]
        prompt_lp = None if c.prompt_logprobs is None else logprobs.prompt_token_logprobs(ids, params, c)
        event = {"text": c.text, "output_ids": c.token_ids,
                 "meta_info": self.job.meta(self.state, i, c.finish_reason, c.completion_tokens, self.cached[i],
                                            c.logprobs, prompt_lp, c.spec, c.preemptions)}
        return [{**event, "index": i} if self.job.batched else event]


class GenerateRoute(Route[NativeGenerateRequest]):
    """SGLang-style: `text` or `input_ids`, `sampling_params` (SGLang names, plus `stop`
    strings), `stream`, and the logprob fields (`return_logprob`, `logprob_start_len`: -1 no
    prompt logprobs, `top_logprobs_num`, `return_text_in_logprobs`). Returns `text`,
    `output_ids` and `meta_info` (with `input/output_token_logprobs` [logprob, id, text] and
    `input/output_top_logprobs` when asked; streamed, each event has its own tokens'). A list of
    prompts (`text` or `input_ids`) or `sampling_params.n` > 1 gives a list of answers,
    prompt-major, and streamed events carry their choice's `index`."""

    request_model = NativeGenerateRequest
    id_prefix = "gen"
    prompt_param = "text"
    size_params = ("top_logprobs_num", "sampling_params.max_new_tokens")
    stream_type = GenerateStream
    job_type = GenerateJob
    # Its hooks take a GenerateJob (job_type makes it), narrower than Route's Job: hence the override ignores.

    def lora_adapter(self, state: ServerState, req: NativeGenerateRequest) -> int:
        return state.lora_adapter(req.lora_path, "lora_path")

    def request_id(self, req: NativeGenerateRequest) -> str:
        return req.rid or super().request_id(req)

    def check(self, state: ServerState, job: GenerateJob) -> None:  # type: ignore[override]
        req = job.req
        raw = dict(req.sampling_params or {})
        n = raw.pop("n", 1)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise bad_request(f"n must be a positive integer, got {n!r}", param="sampling_params.n")
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
        # (The top-level fields' limits were checked on the raw body; these are nested.)
        limits.check_limits(state.args, {**msgspec.structs.asdict(params), "stop": stop, "n": n},
                            prefix="sampling_params.")
        if req.return_logprob:
            k = req.top_logprobs_num
            scored = {"prompt_logprobs": k, "logprob_start_len": req.logprob_start_len} if req.logprob_start_len >= 0 else {}
            params = msgspec.structs.replace(params, logprobs=k, **scored)
        job.stop, job.params, job.n = stop, params, n
        # The logprob lists meta_info carries (with top alternatives when k > 0): output ones when
        # asked; input ones when asked, and with return_logprob always (empty for logprob_start_len -1).
        job.k_out = params.logprobs
        job.k_in = params.prompt_logprobs if params.prompt_logprobs is not None or not req.return_logprob else job.k_out

    async def constrain(self, state: ServerState, job: GenerateJob) -> None:  # type: ignore[override]
        assert job.params is not None
        if job.params.constraint is not None:
            kind, text = job.params.constraint
            await common.check_constraint_param(kind, text, f"sampling_params.{kind}", state.args.max_constraint_bytes)

    def num_choices(self, job: GenerateJob) -> int:  # type: ignore[override]
        return len(job.req.prompts) * job.n

    async def prompts(self, state: ServerState, job: GenerateJob) -> list[list[int]]:  # type: ignore[override]
        req = job.req
        out = []
        for ids in await common.tokenize_prompts(state, req.prompts):
            if req.return_logprob and req.logprob_start_len > len(ids):
                raise bad_request(f"logprob_start_len must be at most the prompt's length ({len(ids)} tokens), got "
                                  f"{req.logprob_start_len}", param="logprob_start_len")
            out.append(ids)
        return out

    def sampling_params(self, state: ServerState, job: GenerateJob, prompt_ids: list[int]) -> list[SamplingParams]:  # type: ignore[override]
        assert job.params is not None
        return job.params.for_choices(job.n)

    def validate(self, state: ServerState, job: GenerateJob, prompt_ids: list[int],  # type: ignore[override]
                 params: SamplingParams) -> None:
        try:
            state.manager.validate_prompt(prompt_ids, params, "text" if job.req.text is not None else "input_ids")
        except InvalidSamplingParams as e:
            raise e.nested("sampling_params") from None

    def answer(self, state: ServerState, job: GenerateJob, results: list[ChoiceResult]) -> dict | list[dict]:  # type: ignore[override]
        latency = time.perf_counter() - job.started
        answers = [
            {
                "text": r.text,
                "output_ids": r.token_ids,
                "meta_info": {**job.meta(state, i, r.finish_reason, r.completion_tokens, r.cached_tokens, r.logprobs,
                                         r.prompt_logprobs, r.spec, r.preemptions),
                              "e2e_latency": latency},
            }
            for i, r in enumerate(results)
        ]
        return answers if job.batched else answers[0]


ROUTE = GenerateRoute()


@router.post("/generate")
async def generate(request: Request):
    return await ROUTE.handle(request)
