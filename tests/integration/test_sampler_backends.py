"""The engine samples the same tokens with the torch sampler and with the Triton kernels
(under the Triton interpreter here), for seeded requests using every sampling feature."""

import pytest

import batonlm

REQUESTS = [
    ("Once upon a time", {"temperature": 0.9, "top_p": 0.8, "seed": 1}),
    ("Lily and Tom", {"temperature": 1.2, "top_k": 20, "min_p": 0.02, "seed": 2, "logprobs": 3}),
    ("The dog", {"temperature": 0.7, "seed": 3, "frequency_penalty": 0.8, "presence_penalty": 0.4,
                 "repetition_penalty": 1.3, "logit_bias": {261: 2.5, 286: -5.0}, "min_new_tokens": 5}),
    ("Sue had a cat", {"temperature": 0.0, "logprobs": 2, "repetition_penalty": 1.5}),
]

def _run(sampler: str) -> list[dict]:
    with batonlm.Engine(sampler=sampler, max_running_requests=8) as engine:
        prompts = [p for p, _ in REQUESTS]
        params = [{**sp, "max_new_tokens": 12} for _, sp in REQUESTS]
        return engine.generate(prompts, sampling_params=params)

def test_torch_and_triton_samplers_agree(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the spawned device worker inherits it
    torch_out = _run("torch")
    triton_out = _run("triton")
    for (prompt, _), a, b in zip(REQUESTS, torch_out, triton_out):
        assert a["output_ids"] == b["output_ids"], prompt
        assert a["finish_reason"] == b["finish_reason"]
    assert len({tuple(o["output_ids"]) for o in torch_out}) == len(REQUESTS)
    # The penalised request avoids the token biased down, and min_new_tokens held.
    assert 286 not in torch_out[2]["output_ids"] and len(torch_out[2]["output_ids"]) >= 5
