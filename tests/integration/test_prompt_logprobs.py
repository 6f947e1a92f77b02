"""Prompt logprobs (`SamplingParams.prompt_logprobs`, `logprob_start_len`) equal transformers'
log_softmax over the prompt, computed in float64 on the same weights: whole prompts and
chunked prefills, both loops, a start position, top alternatives, a cached prefix that must not
skip the scored positions, and retractions.

Tolerance: the engine runs float32; its logits differ from the float64 ones by rounding that
grows about linearly with depth. We allow 64 float32 ulps of the largest logit per layer (a
scored position off by one, or a wrong target, is off by order 1)."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import SchedulerHarness, random_prompts

from batonlm.sampling_params import SamplingParams

EPS32 = torch.finfo(torch.float32).eps


def _reference(path: str, prompt: list[int], top_n: int):
    """float64 (logprob of each prompt token given the ones before, top ids, top logprobs,
    tolerance) by transformers."""
    from transformers import AutoModelForCausalLM

    # Experts one at a time: transformers' default grouped_mm takes no float64.
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, experts_implementation="eager").eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0]
    lp = torch.log_softmax(logits, dim=-1)
    chosen = lp[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    top_lp, top_ids = lp[:-1].topk(top_n, dim=-1) if top_n else (None, None)
    tol = 64 * EPS32 * model.config.num_hidden_layers * float(logits.abs().max())
    return chosen, top_ids, top_lp, tol


def _check(rec, prompt, start, top_n, ref) -> None:
    chosen, top_ids, top_lp, tol = ref
    got = rec.prompt_logprobs
    assert got is not None and len(got) == len(prompt) - start, (len(got or []), len(prompt), start)
    if start == 0:
        assert got[0] is None and rec.prompt_top_logprobs[0] == []
        got, tops, first = got[1:], rec.prompt_top_logprobs[1:], 1
    else:
        tops, first = rec.prompt_top_logprobs, start
    want = chosen[first - 1 :]
    assert torch.allclose(torch.tensor(got, dtype=torch.float64), want, rtol=0, atol=tol), (
        f"max error {float((torch.tensor(got, dtype=torch.float64) - want).abs().max()):.3g} > {tol:.3g}")
    for i, top in enumerate(tops):
        assert len(top) == top_n
        if top_n:
            lps = torch.tensor([lp for _, lp in top], dtype=torch.float64)
            assert torch.allclose(lps, top_lp[first - 1 + i], rtol=0, atol=tol)
            assert lps.tolist() == sorted(lps.tolist(), reverse=True)
            # Ids agree unless two alternatives are within rounding of each other.
            ref_ids = top_ids[first - 1 + i].tolist()
            for j, (tid, _) in enumerate(top):
                if tid != ref_ids[j]:
                    assert abs(float(top_lp[first - 1 + i, j]) - float(lps[j])) <= 2 * tol


@pytest.fixture(scope="module")
def cases(tiny_models, stories_path):
    rng = random.Random(5)
    out = {}
    for name, path in (("stories", stories_path), ("mixtral", tiny_models["mixtral"]),
                       ("deepseek_v3", tiny_models["deepseek_v3"]), ("gemma2", tiny_models["gemma2"])):
        vocab = 512 if name == "stories" else None
        prompts = random_prompts(6, rng, lo=2, hi=120, **({"vocab": vocab} if vocab else {}))
        out[name] = (path, prompts)
    return out


# A Llama, a mixture of experts, latent attention with YaRN, Gemma 2's soft-capped logits (a cap
# changes no greedy token: only logprobs see it).
@pytest.mark.parametrize("name", ["stories", "mixtral", "deepseek_v3", "gemma2"])
@pytest.mark.parametrize("chunk", [None, 16])
def test_prompt_logprobs_match_transformers(cases, name, chunk):
    path, prompts = cases[name]
    specs = [(0, 0), (0, 3), (1, 0), (5, 2), (1, 1), (0, 0)]  # (logprob_start_len, top alternatives)
    specs = [(min(s, len(p)), k) for (s, k), p in zip(specs, prompts)]
    refs = [_reference(path, p, k) for p, (_, k) in zip(prompts, specs)]
    h = SchedulerHarness(path, chunked_prefill_size=chunk)
    try:
        for overlap in (False, True):
            for i, (p, (start, k)) in enumerate(zip(prompts, specs)):
                params = SamplingParams(temperature=0.0, max_new_tokens=3, prompt_logprobs=k, logprob_start_len=start)
                h.submit(f"r{i}", p, params, at=i % 3)
            h.submit("plain", prompts[0], SamplingParams(temperature=0.0, max_new_tokens=4))
            records = h.run(overlap=overlap)
            for i, (p, (start, k)) in enumerate(zip(prompts, specs)):
                _check(records[f"r{i}"], p, start, k, refs[i])
            assert records["plain"].prompt_logprobs is None
            h.assert_all_free()
    finally:
        h.close()


def test_cached_prefix_does_not_skip_scored_positions(stories_path):
    """A prompt whose prefix is cached still gets every prompt logprob it asked for: the match
    stops before the first position whose logits are needed; positions before the start may
    come from the cache."""
    rng = random.Random(11)
    prompt = random_prompts(2, rng, lo=60, hi=60, vocab=512)[0]
    ref = _reference(stories_path, prompt, 0)
    h = SchedulerHarness(stories_path)
    try:
        h.submit("warm", prompt, SamplingParams(temperature=0.0, max_new_tokens=2))
        h.run(overlap=True)
        for start in (0, 30):
            h.submit(f"s{start}", prompt, SamplingParams(temperature=0.0, max_new_tokens=2, prompt_logprobs=0,
                                                         logprob_start_len=start))
            rec = h.run(overlap=True)[f"s{start}"]
            _check(rec, prompt, start, 0, ref)
        assert h.sched.memory.cached_tokens >= 29  # the second one did use the cache up to its start
        h.assert_all_free()
    finally:
        h.close()


def test_retracted_requests_send_their_prompt_logprobs_once(stories_path):
    """Requests retracted for KV (a pool too small for all) and resumed by re-prefilling their
    prompt and outputs return exactly one complete set of prompt logprobs, equal to the
    reference. (A retraction before the first output starts them over: tests/unit/test_kv_memory.py.)"""
    rng = random.Random(3)
    prompts = random_prompts(4, rng, lo=40, hi=70, vocab=512)
    refs = [_reference(stories_path, p, 0) for p in prompts]
    h = SchedulerHarness(stories_path, chunked_prefill_size=8)
    try:
        h.reconfigure(kv_capacity=160, disable_radix_cache=True)
        for i, p in enumerate(prompts):
            h.submit(f"r{i}", p, SamplingParams(temperature=0.0, max_new_tokens=40, prompt_logprobs=0))
        records = h.run(overlap=True)
        assert h.sched.planner.num_retractions > 0
        for i, p in enumerate(prompts):
            _check(records[f"r{i}"], p, 0, 0, refs[i])
        h.assert_all_free()
    finally:
        h.close()
