"""The Triton attention backend (interpreted on the CPU) gives the engine the tokens of the torch
backend: GQA, a sliding window, chunks on cached prefixes, decodes."""

from __future__ import annotations

import importlib.util
import random

import pytest
from helpers import SchedulerHarness, family_with

# Not importorskip: importing triton here, at collection, would fix its interpreter setting
# before tests/kernels/conftest.py sets TRITON_INTERPRET.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")


@pytest.mark.parametrize("model", ["stories", family_with("sliding_window")])  # GQA; GQA and a sliding window
def test_triton_attention_gives_the_torch_tokens(request, monkeypatch, model):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the device worker interprets the kernels
    path = request.getfixturevalue("stories_path") if model == "stories" else request.getfixturevalue("tiny_models")[model]
    rng = random.Random(4)
    shared = [1] + [rng.randrange(3, 512) for _ in range(30)]
    prompts = [shared + [rng.randrange(3, 512) for _ in range(rng.randint(1, 25))] for _ in range(4)]
    params = [{"max_new_tokens": 8, "temperature": 0.0}, {"max_new_tokens": 8, "temperature": 0.8, "seed": 3}]
    outs = {}
    # The torch backend in both loops; the interpreted kernels (a minute a run) in the overlap
    # loop, whose launches are the normal loop's, one iteration ahead.
    for backend, loops in (("torch", (False, True)), ("triton", (True,))):
        # Chunks of 16 tokens on a shared (cached) prefix, beside decodes.
        h = SchedulerHarness(path, attention_backend=backend, chunked_prefill_size=16, max_running_requests=8)
        try:
            for overlap in loops:
                for i, ids in enumerate(prompts):
                    h.submit(f"r{i}", ids, params[i % 2], at=i)
                records = h.run(overlap=overlap)
                h.assert_all_free()
                outs[backend, overlap] = {k: v.token_ids for k, v in records.items()}
        finally:
            h.close()
    assert outs["triton", True] == outs["torch", False] == outs["torch", True]
