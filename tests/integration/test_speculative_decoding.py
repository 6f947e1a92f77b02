"""Speculative decoding with n-gram drafts emits exactly what plain decoding emits: greedy and
seeded, both loops, batches of mixed lengths, requests ending on EOS, a stop token inside an
accepted run of drafts, max_tokens in the middle of one; logprobs agree; every KV slot is free
afterwards. Drafting is forced (cost ratio 0: a draft whenever an n-gram matches) so that the
tests do not depend on timing; the outputs never do."""

from __future__ import annotations

import math
import random

import pytest
from helpers import SchedulerHarness, build_byte_cycle_model, random_prompts

from batonlm.sampling_params import SamplingParams
from batonlm.scheduler.speculative import SpecConfig

ALWAYS = SpecConfig(num_draft_tokens=4, cost_ratio=0.0)
CYCLE_TEXT = "abcdefghijklmnopqrstuvwxyz0123456789"


@pytest.fixture(scope="module")
def cycle_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("cycle") / "model"
    from helpers import copy_tokenizer

    ids = build_byte_cycle_model(path, CYCLE_TEXT)
    copy_tokenizer(path)
    return str(path), ids


def _run(h: SchedulerHarness, jobs, spec: SpecConfig | None, overlap: bool):
    h.reconfigure(speculative=spec)
    for i, (ids, params, at) in enumerate(jobs):
        h.submit(f"r{i}", ids, params, at=at)
    records = h.run(overlap=overlap)
    h.assert_all_free()
    stats = h.sched.speculator.stats if h.sched.speculator is not None else None
    return records, stats


def _same(plain, spec) -> None:
    assert plain.keys() == spec.keys()
    for rid in plain:
        a, b = plain[rid], spec[rid]
        assert b.token_ids == a.token_ids, f"{rid}: {b.token_ids} != {a.token_ids}"
        assert b.finish_reason == a.finish_reason, rid


@pytest.mark.parametrize("overlap", [False, True])
def test_stories_greedy_and_seeded_equal_plain_decoding(stories_path, overlap):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stories_path)
    texts = ["Once upon a time", "Lily and Ben went to the park. Lily and Ben went to the",
             "The cat sat. The cat sat. The cat sat.", "Tom had a red ball. He liked his ball. He"]
    rng = random.Random(0)
    jobs = []
    for i, t in enumerate(texts * 2):
        greedy = i < len(texts)
        params = SamplingParams(max_new_tokens=rng.randint(40, 300), temperature=0.0 if greedy else 0.9,
                                seed=None if greedy else 100 + i)
        jobs.append((tok(t).input_ids, params, i % 3))
    h = SchedulerHarness(stories_path)
    try:
        plain, _ = _run(h, jobs, None, overlap)
        spec, stats = _run(h, jobs, ALWAYS, overlap)
        _same(plain, spec)
        assert stats.steps > 20 and stats.accepted > 10  # it did speculate, and accept
        assert any(r.finish_reason == "stop" for r in plain.values())  # some end on EOS
    finally:
        h.close()


# qwen3_moe: Qwen3's attention (q/k norms), a dense layer and a sparse MoE layer; deepseek_v3:
# latent attention (the pool's latents under verification and rollback) and group routing.
@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "deepseek_v3"])
def test_tiny_families_equal_plain_decoding(tiny_models, family):
    rng = random.Random(3)
    prompts = random_prompts(6, rng, lo=2, hi=90)
    jobs = [(p, SamplingParams(max_new_tokens=rng.randint(5, 60), temperature=0.0), i % 2)
            for i, p in enumerate(prompts)]
    h = SchedulerHarness(tiny_models[family])
    try:
        for overlap in (False, True):
            plain, _ = _run(h, jobs, None, overlap)
            spec, _ = _run(h, jobs, ALWAYS, overlap)
            _same(plain, spec)
    finally:
        h.close()


@pytest.mark.parametrize("algorithm", ["ngram", "draft"])
def test_a_repetitive_output_is_accepted_in_runs_and_stops_exactly(cycle_model, algorithm):
    """A model whose greedy output cycles through a text: after the first cycle nearly every
    draft is accepted (n-grams; or the model as its own draft model); a stop token in the middle
    of an accepted run ends the request there, and max_tokens mid-run cuts it to the exact
    length. (With a draft model a sampled request is drawn differently from a plain run, the
    same in both loops.)"""
    path, cycle = cycle_model
    draft = algorithm == "draft"
    stop = cycle[20]
    jobs = [
        ([1], SamplingParams(max_new_tokens=150, temperature=0.0), 0),
        ([1], SamplingParams(max_new_tokens=97, temperature=0.0), 0),  # not a multiple of anything
        # The prompt holds a whole cycle: drafts match from the first step, and the stop token
        # (17 tokens in) falls inside a run of accepted drafts.
        ([1] + cycle + cycle[:3], SamplingParams(max_new_tokens=150, temperature=0.0, stop_token_ids=[stop]), 1),
        ([1], SamplingParams(max_new_tokens=150, temperature=0.7, seed=5), 2),
    ]
    config = SpecConfig(cost_ratio=0.0, draft_model=True) if draft else ALWAYS
    h = SchedulerHarness(path, **({"speculative_algorithm": "draft", "speculative_draft_model": path} if draft else {}))
    try:
        sampled = []
        for overlap in (False, True):
            plain, _ = _run(h, jobs, None, overlap)
            spec, stats = _run(h, jobs, config, overlap)
            if draft:
                sampled.append(spec.pop("r3").token_ids)
                plain.pop("r3")
            _same(plain, spec)
            assert len(spec["r1"].token_ids) == 97 and spec["r1"].finish_reason == "length"
            stopped = spec["r2"].token_ids
            assert stopped == cycle[3:21] and spec["r2"].finish_reason == "stop"
            assert stats.accepted / stats.steps > 3.0, stats.hist  # long accepted runs
        assert not sampled or sampled[0] == sampled[1]
    finally:
        h.close()


def test_logprobs_agree_with_plain_decoding(cycle_model, stories_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stories_path)
    ids = tok("The cat sat. The cat sat. The cat sat.").input_ids
    params = SamplingParams(max_new_tokens=60, temperature=0.0, logprobs=2)
    h = SchedulerHarness(stories_path)
    try:
        plain, _ = _run(h, [(ids, params, 0)], None, True)
        spec, stats = _run(h, [(ids, params, 0)], ALWAYS, True)
        _same(plain, spec)
        assert stats.accepted > 0
        a, b = plain["r0"].logprobs, spec["r0"].logprobs
        assert len(a) == len(b) == 60
        # The same positions through differently shaped batches: float32 rounding only.
        assert all(math.isclose(x, y, abs_tol=1e-4) for x, y in zip(a, b))
    finally:
        h.close()


def test_constrained_requests_draft_and_keep_to_their_grammar(stories_path):
    """JSON arrays of objects repeat their keys: n-gram drafts match. Each verifying row is
    masked by the state after the drafts before it, so the output is what plain constrained
    decoding gives (greedy and seeded, both loops), valid against its schema; the seed's rule
    holds the verifying batch until the previous result is processed."""
    import json

    import jsonschema

    schema = {"type": "array", "minItems": 4, "maxItems": 4, "items": {
        "type": "object", "properties": {"kind": {"enum": ["cat", "dog", "bird"]}, "age": {"type": "integer",
                                                                                       "minimum": 1, "maximum": 9}},
        "required": ["kind", "age"], "additionalProperties": False}}
    jobs = [([1, 403, 407], SamplingParams(max_new_tokens=400, temperature=0.0, json_schema=json.dumps(schema)), 0),
            ([1, 261], SamplingParams(max_new_tokens=400, temperature=0.8, seed=3, json_schema=json.dumps(schema)), 1),
            ([1, 300, 301], SamplingParams(max_new_tokens=40, temperature=0.0), 0)]
    h = SchedulerHarness(stories_path)
    try:
        for overlap in (False, True):
            plain, _ = _run(h, jobs, None, overlap)
            spec, stats = _run(h, jobs, ALWAYS, overlap)
            _same(plain, spec)
            assert stats.steps > 5 and stats.accepted > 5, stats.hist
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(stories_path)
            for rid in ("r0", "r1"):
                jsonschema.validate(json.loads(tok.decode(spec[rid].token_ids, skip_special_tokens=True)), schema)
    finally:
        h.close()


def test_drafts_are_accepted_beside_a_chunked_prefill(cycle_model):
    """Verify rows behind a prefill chunk (several tokens in one row) still compare each draft
    with its own row's input: a copying request keeps accepting while another's long prompt is
    computed 8 tokens per iteration beside it."""
    path, cycle = cycle_model
    long_prompt = [1] + (cycle * 7)[:230]
    jobs = [([1, *cycle, *cycle[:3]], SamplingParams(max_new_tokens=100, temperature=0.0), 0),
            (long_prompt, SamplingParams(max_new_tokens=2, temperature=0.0), 2)]
    h = SchedulerHarness(path, chunked_prefill_size=8)
    try:
        plain, _ = _run(h, jobs, None, False)
        spec, stats = _run(h, jobs, ALWAYS, False)
        _same(plain, spec)
        # r0 verifies beside r1's ~29 prefill chunks: each step still accepts (nearly) all drafts.
        assert stats.accepted / stats.steps > 3.0, stats.hist
    finally:
        h.close()


@pytest.mark.parametrize("draft", ["same", "random"])
def test_a_draft_model_keeps_greedy_output_and_seeded_runs_reproducible(stories_path, tiny_models, draft):
    """--speculative-algorithm draft: the draft model (its own KV pool, synced on every
    forward) drafts on the device and the target verifies by rejection sampling. Greedy
    requests emit the plain greedy tokens whatever the draft (the same model: nearly every
    draft accepted; a random one: nearly none); seeded sampled requests are reproducible, the
    same in both loops (their distribution: tests/unit/test_spec_rejection.py)."""
    draft_path = stories_path if draft == "same" else tiny_models["llama"]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stories_path)
    prompts = [tok(t).input_ids for t in ("Once upon a time", "Lily and Ben went to the park.", "The cat sat.")]
    greedy = [(p, SamplingParams(max_new_tokens=60, temperature=0.0), i) for i, p in enumerate(prompts)]
    sampled = [(p, SamplingParams(max_new_tokens=60, temperature=0.8, seed=9 + i), i) for i, p in enumerate(prompts)]
    spec = SpecConfig(num_draft_tokens=4, cost_ratio=0.0, draft_model=True)
    h = SchedulerHarness(stories_path, speculative_algorithm="draft", speculative_draft_model=draft_path)
    try:
        plain, _ = _run(h, greedy, None, True)
        for overlap in (False, True):
            got, stats = _run(h, greedy, spec, overlap)
            _same(plain, got)
            rate = stats.accepted / stats.drafted
            assert rate > 0.9 if draft == "same" else rate < 0.2, stats.hist
        a, _ = _run(h, sampled, spec, False)
        b, _ = _run(h, sampled, spec, True)
        _same(a, b)
    finally:
        h.close()
