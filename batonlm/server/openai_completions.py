"""POST /v1/completions on the request pipeline (prompt: a string, a list of strings, token ids,
or lists of token ids).

With `echo` the prompt comes back before the completion, and with `logprobs` too, its tokens'
logprobs (the first token's null: nothing precedes it); `max_tokens: 0` (with `echo` only)
scores the prompt without completing it: the prefill runs, its one sampled token is dropped.
"""

from __future__ import annotations

import msgspec
from fastapi import APIRouter, Request

from batonlm.sampling_params import SamplingParams
from batonlm.server import logprobs
from batonlm.server.errors import bad_request
from batonlm.server.openai_common import OpenAIRoute, OpenAIStream, num_prompts, prompt_ids
from batonlm.server.pipeline import ChoiceResult, Job
from batonlm.server.protocol import CompletionRequest
from batonlm.server.state import ServerState
from batonlm.tokenizer_manager.request_state import GenerationChunk

router = APIRouter()

CompletionJob = Job[CompletionRequest]


def _echoes(state: ServerState, job: CompletionJob) -> list[tuple[str, list[int]]]:
    """Each choice's echoed prompt and its tokens' offsets in it (empty without `echo`)."""
    if not job.req.echo:
        return [("", [])] * len(job.choices)
    token_ids = not isinstance(job.req.prompt, str) and not any(isinstance(p, str) for p in job.req.prompt)
    return [logprobs.echo(state.tokenizer, ids, keep_special=token_ids) for ids, _ in job.choices]


class CompletionStream(OpenAIStream[CompletionRequest]):
    """Each choice's first event carries its echo (and the prompt's logprobs, which come with
    the first token); a max_tokens 0 choice then ends without a token."""

    object_name = "text_completion"

    def __init__(self, state: ServerState, job: CompletionJob) -> None:
        super().__init__(state, job)
        self.prompt_only = job.req.max_tokens == 0
        self.counts_completion = not self.prompt_only
        self.echoes = _echoes(state, job)
        self.offsets = [0] * len(job.choices)
        self.opened = [False] * len(job.choices)

    def choice_deltas(self, i: int, c: GenerationChunk) -> list[dict]:
        req = self.job.req
        text, items = ("", []) if self.prompt_only else (c.text, c.logprobs or [])
        prompt_offsets: list[int] = []
        echoed = 0  # characters of `text` that are the echo
        if not self.opened[i] and (c.token_ids or c.finish_reason is not None):
            self.opened[i] = True
            echo, offsets = self.echoes[i]
            text = echo + text
            if c.prompt_logprobs is not None:
                scored = logprobs.prompt_token_logprobs(*self.job.choices[i], c)
                items = scored + items
                prompt_offsets = offsets[len(offsets) - len(scored):]
            self.offsets[i] = echoed = len(echo)
        finish = None if c.finish_reason is None else "length" if self.prompt_only else c.finish_reason
        if not (text or (req.logprobs is not None and items) or finish):
            return []
        # The last token's chunk carries the finish reason (no separate empty chunk after it).
        lp = None
        if req.logprobs is not None:
            lp = logprobs.completion_logprobs(self.state, items, self.offsets[i], prompt_offsets)
        self.offsets[i] += len(text) - echoed
        return [{"index": i, "text": text, "logprobs": lp, "finish_reason": finish}]


class CompletionsRoute(OpenAIRoute[CompletionRequest]):
    request_model = CompletionRequest
    id_prefix = "cmpl"
    prompt_param = "prompt"
    object_name = "text_completion"
    stream_type = CompletionStream

    def check(self, state: ServerState, job: CompletionJob) -> None:
        if job.req.max_tokens == 0 and not job.req.echo:
            raise bad_request("max_tokens 0 is allowed only with echo (to score the prompt)", param="max_tokens")
        super().check(state, job)

    def num_choices(self, job: CompletionJob) -> int:
        return num_prompts(job.req.prompt) * job.n

    async def prompts(self, state: ServerState, job: CompletionJob) -> list[list[int]]:
        return await prompt_ids(state, job.req.prompt)

    def sampling_params(self, state: ServerState, job: CompletionJob, prompt_ids: list[int]) -> list[SamplingParams]:
        params = super().sampling_params(state, job, prompt_ids)
        req = job.req
        changes: dict = {"prompt_logprobs": req.logprobs} if req.echo and req.logprobs is not None else {}
        if req.max_tokens == 0:
            changes["max_new_tokens"] = 1
        return [msgspec.structs.replace(p, **changes) for p in params] if changes else params

    def answer(self, state: ServerState, job: CompletionJob, results: list[ChoiceResult]) -> dict:
        if job.req.max_tokens == 0:  # the prompt alone (its one sampled token dropped, not counted)
            results = [ChoiceResult(prompt_logprobs=r.prompt_logprobs, finish_reason="length",
                                    cached_tokens=r.cached_tokens) for r in results]
        return super().answer(state, job, results)

    def choices(self, state: ServerState, job: CompletionJob, results: list[ChoiceResult]) -> list[dict]:
        echoes = _echoes(state, job)
        out = []
        for i, r in enumerate(results):
            echo, offsets = echoes[i]
            scored = r.prompt_logprobs or []
            lp = None
            if job.req.logprobs is not None:
                lp = logprobs.completion_logprobs(state, scored + r.logprobs, len(echo),
                                                  offsets[len(offsets) - len(scored):] if scored else [])
            out.append({"index": i, "text": echo + r.text, "logprobs": lp, "finish_reason": r.finish_reason})
        return out


ROUTE = CompletionsRoute()


@router.post("/v1/completions")
async def completions(request: Request):
    return await ROUTE.handle(request)
