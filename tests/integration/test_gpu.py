"""The CUDA device path: forward and copy streams, pinned copies, the Triton sampler.
These run only where CUDA is available (benchmarks/gpu_check.sh runs them in one go)."""

import random

import pytest
from helpers import SchedulerHarness, hf_greedy, random_prompts

pytestmark = pytest.mark.gpu


def _run(h: SchedulerHarness, reqs, overlap: bool):
    for rid, ids, params, at in reqs:
        h.submit(rid, ids, params, at=at)
    records = h.run(overlap=overlap)
    h.assert_all_free()
    return {k: v.token_ids for k, v in records.items()}


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_cuda_greedy_matches_transformers(tiny_models, family):
    rng = random.Random(5)
    prompts = random_prompts(8, rng, lo=1, hi=200)
    max_new = [rng.randint(8, 24) for _ in prompts]
    expected = hf_greedy(tiny_models[family], prompts, max_new)
    h = SchedulerHarness(tiny_models[family], device="cuda", dtype="float32", sampler="triton")
    try:
        reqs = [(f"r{i}", p, {"temperature": 0.0, "max_new_tokens": n}, 2 * i)
                for i, (p, n) in enumerate(zip(prompts, max_new))]
        got = _run(h, reqs, overlap=True)
        assert [got[f"r{i}"] for i in range(len(prompts))] == expected
    finally:
        h.close()


def test_cuda_overlap_equals_normal_with_triton_sampling(stories_path):
    rng = random.Random(9)
    reqs = []
    for i in range(32):
        ids = [1] + [rng.randrange(3, 512) for _ in range(rng.randint(1, 100))]
        params = {"max_new_tokens": rng.randint(1, 64), "temperature": rng.choice([0.0, 0.8]),
                  "top_p": 0.9, "seed": rng.randrange(2**32)}
        reqs.append((f"r{i}", ids, params, rng.randint(0, 40)))
    h = SchedulerHarness(stories_path, device="cuda", sampler="triton", dtype="float32")
    try:
        assert _run(h, reqs, overlap=False) == _run(h, reqs, overlap=True)
    finally:
        h.close()


def test_cuda_torch_and_triton_samplers_agree(stories_path):
    reqs = [(f"r{i}", [1, 403, 407, 261, 378][: i + 1],
             {"max_new_tokens": 32, "temperature": 1.0, "top_k": 40, "top_p": 0.9, "seed": i,
              "frequency_penalty": 0.5, "logit_bias": {261: 1.0}}, 0) for i in range(5)]
    outs = []
    for sampler in ("torch", "triton"):
        h = SchedulerHarness(stories_path, device="cuda", sampler=sampler, dtype="float32")
        try:
            outs.append(_run(h, reqs, overlap=True))
        finally:
            h.close()
    assert outs[0] == outs[1]


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_cuda_triton_attention_equals_torch_attention(tiny_models, family):
    """Greedy tokens through the Triton attention backend (the CUDA default) and the torch one,
    with chunks on a shared cached prefix and decodes (GQA; a sliding window for mistral)."""
    rng = random.Random(6)
    shared = [1] + [rng.randrange(3, 512) for _ in range(40)]
    reqs = [(f"r{i}", shared + [rng.randrange(3, 512) for _ in range(rng.randint(1, 60))],
             {"max_new_tokens": 24, "temperature": 0.0}, i) for i in range(10)]
    outs = []
    for backend in ("torch", "triton"):
        h = SchedulerHarness(tiny_models[family], device="cuda", dtype="float32", attention_backend=backend,
                             chunked_prefill_size=32)
        try:
            outs.append(_run(h, reqs, overlap=True))
        finally:
            h.close()
    assert outs[0] == outs[1]
