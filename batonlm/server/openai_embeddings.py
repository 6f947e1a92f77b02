"""POST /v1/embeddings on the request pipeline: each input's prompt is computed like any
prefill (batched, chunked, cached) and its last hidden states pooled (`--pooling`: the last
token's or the mean) in the scheduler; no token is generated. Vectors are L2-normalised (after
`dimensions` truncates them, Matryoshka-style), as OpenAI's are, and sent as floats or as
base64 of little-endian float32 (what the `openai` client asks for by default)."""

from __future__ import annotations

import array
import base64
import sys

from fastapi import APIRouter, Request

from batonlm.pooling import finish_vector, pooling_of
from batonlm.sampling_params import SamplingParams
from batonlm.server.errors import bad_request
from batonlm.server.openai_common import num_prompts, prompt_ids
from batonlm.server.pipeline import ChoiceResult, Job, Route, Stream
from batonlm.server.protocol import EmbeddingRequest
from batonlm.server.state import ServerState

router = APIRouter()

EmbeddingJob = Job[EmbeddingRequest]


def encode(vector: array.array, encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector.tolist()
    if sys.byteorder == "big":  # OpenAI's base64 holds little-endian float32
        vector = array.array("f", vector)
        vector.byteswap()
    return base64.b64encode(vector.tobytes()).decode("ascii")


class EmbeddingsRoute(Route[EmbeddingRequest]):
    request_model = EmbeddingRequest
    id_prefix = "embd"
    prompt_param = "input"
    stream_type = Stream  # never streamed
    generates = False
    size_params = ("input", "input")

    def check(self, state: ServerState, job: EmbeddingJob) -> None:
        req = job.req
        limit = state.args.max_prompts_per_request
        if self.num_choices(job) > limit:
            raise bad_request(f"at most {limit} inputs per request are allowed, got {self.num_choices(job)}",
                              param="input", code="limit_exceeded")
        info = state.manager.info
        assert info is not None  # healthy: the scheduler is running
        if req.dimensions is not None and req.dimensions > info.hidden_size:
            raise bad_request(f"dimensions is {req.dimensions}, more than the model's {info.hidden_size}",
                              param="dimensions")
        job.pooling = pooling_of(state.args.pooling, info.model_path)

    def num_choices(self, job: EmbeddingJob) -> int:
        return num_prompts(job.req.input)

    async def prompts(self, state: ServerState, job: EmbeddingJob) -> list[list[int]]:
        return await prompt_ids(state, job.req.input)

    def sampling_params(self, state: ServerState, job: EmbeddingJob, prompt_ids: list[int]) -> list[SamplingParams]:
        return [SamplingParams(temperature=0.0, max_new_tokens=1)]  # the one token is dropped

    def answer(self, state: ServerState, job: EmbeddingJob, results: list[ChoiceResult]) -> dict:
        data = []
        for i, r in enumerate(results):
            assert r.embedding is not None  # every choice of an embedding request pools
            vector = finish_vector(r.embedding, job.req.dimensions)
            data.append({"object": "embedding", "index": i, "embedding": encode(vector, job.req.encoding_format)})
        return {
            "object": "list",
            "data": data,
            "model": state.model_name,
            "usage": {"prompt_tokens": job.prompt_tokens, "total_tokens": job.prompt_tokens},
        }


ROUTE = EmbeddingsRoute()


@router.post("/v1/embeddings")
async def embeddings(request: Request):
    return await ROUTE.handle(request)
