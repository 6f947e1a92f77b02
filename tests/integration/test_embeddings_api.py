"""POST /v1/embeddings through the official `openai` client: vectors equal to transformers'
last hidden states pooled the same way and L2-normalised (float64 reference, the float32 bound
of tests/helpers.py `pooled_reference`), base64 (the client's default) decoding to the very
floats of encoding_format float, `dimensions` truncating and renormalising, token-id inputs, and
an embedding model's checkpoint (Qwen3Model with a sentence-transformers pooling config: mean
pooling, chosen by --pooling auto) that refuses the generation routes."""

from __future__ import annotations

import base64
import struct

import httpx
import pytest
import torch
from helpers import build_embedding_model, pooled_reference

from batonlm.bench.server_process import ServerProcess

TEXTS = ["Once upon a time", "The little cat sat on the warm mat and slept.", "Lily"]
EPS32 = torch.finfo(torch.float32).eps


def check_normalised(got: list[float], ref: tuple[torch.Tensor, float], dims: int | None = None) -> None:
    """`got` is the reference's first `dims` values, normalised. The raw values' error bound
    `tol`, divided by the norm, bounds the normalised values' (twice: the norm errs too)."""
    want, tol = ref
    want = want[:dims] if dims else want
    norm = float(want.norm())
    got64 = torch.tensor(got, dtype=torch.float64)
    assert got64.shape == want.shape
    assert abs(float(got64.norm()) - 1) <= 8 * EPS32 * len(got)
    err = float((got64 - want / norm).abs().max())
    bound = 2 * tol / norm + 2 * EPS32
    assert err <= bound, f"max error {err:.3g} > {bound:.3g}"


def test_client_embeddings_equal_transformers(client, stories_path):
    from transformers import AutoTokenizer

    ids = [AutoTokenizer.from_pretrained(stories_path)(t)["input_ids"] for t in TEXTS]
    refs = [pooled_reference(stories_path, p, "last") for p in ids]  # --pooling auto: last without a config
    default = client.embeddings.create(model="stories260K", input=TEXTS)  # base64 on the wire
    floats = client.embeddings.create(model="stories260K", input=TEXTS, encoding_format="float")
    assert default.usage.prompt_tokens == default.usage.total_tokens == sum(map(len, ids))
    assert [d.index for d in default.data] == [0, 1, 2] and default.model == "stories260K"
    for i, ref in enumerate(refs):
        check_normalised(default.data[i].embedding, ref)
        check_normalised(floats.data[i].embedding, ref)
    # The same computation (one input, on its cached prefix, alone: a batch's makeup changes
    # float32 rounding) gives the same float32 values in either encoding.
    client.embeddings.create(model="stories260K", input=TEXTS[1])
    one = [client.embeddings.create(model="stories260K", input=TEXTS[1], **kw).data[0].embedding
           for kw in ({}, {"encoding_format": "float"})]
    assert one[0] == one[1]
    # Token ids, and Matryoshka dimensions: the first 16 values renormalised.
    short = client.embeddings.create(model="stories260K", input=ids, encoding_format="float", dimensions=16)
    for i, ref in enumerate(refs):
        assert len(short.data[i].embedding) == 16
        check_normalised(short.data[i].embedding, ref, dims=16)


def test_base64_is_little_endian_float32(server):
    body = {"input": TEXTS[0]}
    httpx.post(server.base_url + "/v1/embeddings", json=body, timeout=60)  # cached: the next two compute alike
    raw = httpx.post(server.base_url + "/v1/embeddings", json={**body, "encoding_format": "base64"}, timeout=60).json()
    floats = httpx.post(server.base_url + "/v1/embeddings", json=body, timeout=60).json()
    data = base64.b64decode(raw["data"][0]["embedding"])
    values = list(struct.unpack(f"<{len(data) // 4}f", data))
    assert values == floats["data"][0]["embedding"] and len(values) == 64


@pytest.fixture(scope="module")
def embedding_server(tmp_path_factory):
    path = build_embedding_model(tmp_path_factory.mktemp("embedder"), pooling="mean")
    s = ServerProcess(path, "--served-model-name", "tiny-embedder")
    yield s, path
    assert s.stop() == 0, s.log()


def test_an_embedding_model_pools_as_its_config_says_and_generates_nothing(embedding_server):
    import openai
    from transformers import AutoTokenizer

    server, path = embedding_server
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    ids = [AutoTokenizer.from_pretrained(path)(t)["input_ids"] for t in TEXTS]
    got = client.embeddings.create(model="tiny-embedder", input=TEXTS)
    for i, p in enumerate(ids):
        check_normalised(got.data[i].embedding, pooled_reference(path, p, "mean"))
    for route, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                        ("/v1/completions", {"prompt": "hi"}), ("/generate", {"text": "hi"}),
                        ("/v1/responses", {"input": "hi"})):
        r = httpx.post(server.base_url + route, json=body, timeout=60)
        assert r.status_code == 400, (route, r.text)
        err = r.json()["error"]
        assert (err["param"], err["code"]) == ("model", "embedding_model") and "/v1/embeddings" in err["message"]
    r = httpx.post(server.base_url + "/v1/messages", json={"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["type"] == "error" and "embedding model" in r.json()["error"]["message"]
    # The metrics count the prompts embedded, and no generated token.
    from prometheus_client.parser import text_string_to_metric_families

    samples = {(s.name, s.labels.get("finish_reason")): s.value
               for f in text_string_to_metric_families(httpx.get(server.base_url + "/metrics").text) for s in f.samples}
    assert samples[("batonlm_prompt_tokens_total", None)] == sum(map(len, ids))
    assert samples[("batonlm_generation_tokens_total", None)] == 0
    assert samples[("batonlm_requests_finished_total", "stop")] == len(TEXTS)
