"""Embeddings (`GenerateRequest.pooling`): the prompt's last hidden states (after the final
norm, transformers' `last_hidden_state`) pooled by the last token or the mean, equal to
transformers' base model run in float64 on the same weights: whole prompts and chunked
prefills, both loops, a cached prefix (last-token pooling may use one; mean pooling must not),
and a base-model checkpoint (`Qwen3Model`, an embedding model's save). A retraction starting the
sums over: tests/unit/test_kv_memory.py.

Tolerance: the engine runs float32; its hidden states differ from the float64 ones by rounding
that grows about linearly with depth. We allow 64 float32 ulps of the largest reference value
per layer (a wrong position, a missed chunk or the norm left out are off by order 1)."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import SchedulerHarness, pooled_reference, random_prompts

from batonlm.sampling_params import SamplingParams

EMBED = SamplingParams(temperature=0.0, max_new_tokens=1)


def check(got: list[float] | None, ref: tuple[torch.Tensor, float]) -> None:
    """An engine's pooled hidden states against pooled_reference's (float64, tolerance)."""
    want, tol = ref
    assert got is not None and len(got) == want.shape[0]
    err = float((torch.tensor(got, dtype=torch.float64) - want).abs().max())
    assert err <= tol, f"max error {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("chunk", [None, 16])
def test_pooled_hidden_states_match_transformers(stories_path, chunk):
    rng = random.Random(7)
    prompts = random_prompts(5, rng, lo=2, hi=90, vocab=512)
    modes = ["last", "mean", "mean", "last", "mean"]
    refs = [pooled_reference(stories_path, p, m) for p, m in zip(prompts, modes)]
    h = SchedulerHarness(stories_path, chunked_prefill_size=chunk)
    try:
        for overlap in (False, True):
            for i, (p, m) in enumerate(zip(prompts, modes)):
                h.submit(f"e{i}", p, EMBED, at=i % 2, pooling=m)
            h.submit("plain", prompts[0], SamplingParams(temperature=0.0, max_new_tokens=5))
            records = h.run(overlap=overlap)
            for i, ref in enumerate(refs):
                rec = records[f"e{i}"]
                assert rec.finish_reason == "length" and len(rec.token_ids) == 1
                check(rec.embedding, ref)
            assert records["plain"].embedding is None and len(records["plain"].token_ids) == 5
            h.assert_all_free()
    finally:
        h.close()


def test_cached_prefix(stories_path):
    """Last-token pooling may start on a cached prefix (only the last position is pooled);
    mean pooling computes every position again."""
    prompt = random_prompts(2, random.Random(2), lo=50, hi=50, vocab=512)[0]
    h = SchedulerHarness(stories_path)
    try:
        h.submit("warm", prompt + [7, 8], SamplingParams(temperature=0.0, max_new_tokens=2))
        h.run(overlap=True)
        before = h.sched.memory.cached_tokens
        h.submit("last", prompt, EMBED, pooling="last")
        check(h.run(overlap=True)["last"].embedding, pooled_reference(stories_path, prompt, "last"))
        assert h.sched.memory.cached_tokens - before == len(prompt) - 1
        before = h.sched.memory.cached_tokens
        h.submit("mean", prompt, EMBED, pooling="mean")
        check(h.run(overlap=True)["mean"].embedding, pooled_reference(stories_path, prompt, "mean"))
        assert h.sched.memory.cached_tokens == before
        h.assert_all_free()
    finally:
        h.close()


@pytest.fixture(scope="module")
def qwen3_embedding_model(tmp_path_factory) -> str:
    from helpers import build_embedding_model

    return build_embedding_model(tmp_path_factory.mktemp("qwen3_embedding"))


def test_a_base_model_checkpoint_serves_embeddings(qwen3_embedding_model):
    import json
    from pathlib import Path

    from safetensors import safe_open

    raw = json.loads((Path(qwen3_embedding_model) / "config.json").read_text())
    assert raw["architectures"] == ["Qwen3Model"]
    with safe_open(str(Path(qwen3_embedding_model) / "model.safetensors"), framework="pt") as sf:
        assert not any(k.startswith(("model.", "lm_head")) for k in sf.keys())
    prompts = random_prompts(3, random.Random(4), lo=3, hi=40, vocab=400)
    h = SchedulerHarness(qwen3_embedding_model, chunked_prefill_size=16)
    try:
        assert h.info.embedding_only
        for overlap in (False, True):
            for i, p in enumerate(prompts):
                for mode in ("last", "mean"):
                    h.submit(f"{mode}{i}", p, EMBED, pooling=mode)
            records = h.run(overlap=overlap)
            for i, p in enumerate(prompts):
                for mode in ("last", "mean"):
                    check(records[f"{mode}{i}"].embedding, pooled_reference(qwen3_embedding_model, p, mode))
        h.assert_all_free()
    finally:
        h.close()
