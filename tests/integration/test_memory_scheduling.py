"""Memory-aware scheduling changes nothing a client sees: the prefix cache on or off, prompts cut
into chunks of 1, 7 or 64 tokens or none, a pool so small that most requests are retracted and
resumed, either loop, either admission policy, n-gram speculative decoding: every request of
every family gets the same tokens (greedy, and seeded sampling with penalties), and the pool
ends with everything free."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from helpers import TEST_FAMILIES, SchedulerHarness

from batonlm.sampling_params import SamplingParams
from batonlm.scheduler.planner import NewTokenRatio
from batonlm.scheduler.speculative import SpecConfig

MODELS = ["stories", *TEST_FAMILIES]


def workload(seed: int, long_prompt: bool, vocab: int = 512):
    """16 requests (and a long one): prompts that share one of three system prompts (or repeat outright), greedy
    and seeded-sampled, one with penalties and a minimum length, arriving over 3 iterations."""
    rng = random.Random(seed)
    systems = [[1] + [rng.randrange(3, vocab) for _ in range(n)] for n in (8, 12, 15)]
    reqs = []
    for i in range(16):
        prompt = systems[i % 3] + [rng.randrange(3, vocab) for _ in range(rng.randint(1, 20))]
        if i == 15:
            prompt = reqs[3][1]  # the same prompt again
        params: dict = {"max_new_tokens": rng.randint(20, 40)}
        if i % 2:
            params.update(temperature=0.0)
        else:
            params.update(temperature=0.8, top_p=0.9, top_k=40, seed=1000 + i)
        if i == 4:
            params.update(frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.2, min_new_tokens=3)
        reqs.append((f"r{i}", prompt, SamplingParams(**params), rng.randint(0, 3)))
    if long_prompt:  # cut by a chunk of 64 too; on the first system prompt
        long = systems[0] + [rng.randrange(3, vocab) for _ in range(120)]
        reqs.append(("long", long, SamplingParams(max_new_tokens=4, temperature=0.0), 2))
    return reqs


# (label, SchedulerConfig changes, kv capacity (None: the device's), overlap)
# Without the long prompt, the longest request holds 36 + 40 - 1 slots: it only just fits.
WHOLE, SMALL_POOL = None, 80
CONFIGS = [
    ("cache on, whole prompts, overlap", dict(disable_radix_cache=False, chunked_prefill_size=WHOLE), None, True),
    ("cache on, chunk 7, normal", dict(disable_radix_cache=False, chunked_prefill_size=7), None, False),
    ("cache on, chunk 64, overlap", dict(disable_radix_cache=False, chunked_prefill_size=64), None, True),
    ("cache off, chunk 7, overlap", dict(disable_radix_cache=True, chunked_prefill_size=7), None, True),
    ("lpm policy, chunk 7, overlap", dict(disable_radix_cache=False, chunked_prefill_size=7, schedule_policy="lpm"), None, True),
    ("retraction, cache on, chunk 7, overlap", dict(disable_radix_cache=False, chunked_prefill_size=7), SMALL_POOL, True),
    ("retraction, cache on, whole, normal", dict(disable_radix_cache=False, chunked_prefill_size=WHOLE), SMALL_POOL, False),
    ("retraction, cache off, chunk 64, overlap", dict(disable_radix_cache=True, chunked_prefill_size=64), SMALL_POOL, True),
    # Last: the settings carry over to the next scheme. N-gram drafts wherever one matches,
    # verified and rolled back while requests are retracted and resumed (one-token n-grams: a
    # random model's outputs seldom repeat two).
    ("retraction, n-gram drafts, cache on, chunk 7, overlap",
     dict(disable_radix_cache=False, chunked_prefill_size=7, speculative=SpecConfig(num_draft_tokens=4, cost_ratio=0.0, ngram_min=1)),
     SMALL_POOL, True),
]
# Chunks of one token cost an iteration per prompt token: run on one model.
CHUNK_1 = [
    ("cache on, chunk 1, overlap", dict(disable_radix_cache=False, chunked_prefill_size=1, speculative=None), None, True),
    ("small pool, cache on, chunk 1, normal", dict(disable_radix_cache=False, chunked_prefill_size=1), SMALL_POOL,
     False),
]


def _run(h: SchedulerHarness, reqs, overlap: bool) -> dict[str, tuple[list[int], str]]:
    for rid, ids, params, at in reqs:
        h.submit(rid, ids, params, at=at)
    records = h.run(overlap=overlap)
    h.assert_all_free()
    return {rid: (rec.token_ids, rec.finish_reason) for rid, rec in records.items()}


@pytest.mark.parametrize("model", MODELS)
def test_the_same_tokens_under_every_memory_scheme(request, model):
    path = request.getfixturevalue("stories_path") if model == "stories" else request.getfixturevalue("tiny_models")[model]
    workloads = {long: workload(MODELS.index(model), long_prompt=long) for long in (True, False)}
    h = SchedulerHarness(path, max_running_requests=16, max_total_tokens=4096)
    retracted: dict[str, set[str]] = {}
    try:
        # The reference: no cache, whole prompts, the normal loop, a pool that fits everything.
        h.reconfigure(disable_radix_cache=True, chunked_prefill_size=None)
        references = {long: _run(h, reqs, overlap=False) for long, reqs in workloads.items()}
        for label, changes, capacity, overlap in CONFIGS + (CHUNK_1 if model == "stories" else []):
            reqs, expected = workloads[capacity is None], references[capacity is None]
            h.reconfigure(kv_capacity=capacity, **changes)
            seen: set[str] = set()
            planner_retract = h.sched.planner._retract

            def spy(req, running, _seen=seen, _orig=planner_retract):
                _seen.add(req.rid)
                _orig(req, running)

            h.sched.planner._retract = spy
            if capacity is not None:
                # Admit on the prompt alone (no room kept for outputs): decodes then run out of
                # slots all the time, and requests are retracted and resumed again and again.
                h.sched.planner.ratio = NewTokenRatio(init=0.0, minimum=0.0)
            got = _run(h, reqs, overlap)
            assert got == expected, f"{model}, {label}: " + ", ".join(
                f"{rid} {got[rid]} != {expected[rid]}" for rid in expected if got.get(rid) != expected[rid])
            retracted[label] = seen
            if "n-gram" in label:  # drafts were made and verified
                assert h.sched.speculator is not None and h.sched.speculator.stats.steps > 0, label
    finally:
        h.close()
    for label, seen in retracted.items():  # the small pool really retracted most requests
        if label.startswith("retraction"):
            assert len(seen) >= len(workloads[False]) // 2, f"{label}: only {sorted(seen)} retracted"
        elif not label.startswith("small pool"):
            assert not seen, f"{label}: retracted {sorted(seen)} with room for all"


def test_the_cache_serves_repeated_prefixes(stories_path):
    """Prompts that share a system prompt are computed once: the later ones report cached tokens."""
    h = SchedulerHarness(stories_path, max_running_requests=16)
    try:
        system = [1] + list(range(300, 360))
        h.submit("first", system + [400, 401], {"max_new_tokens": 4, "temperature": 0.0})
        h.run(overlap=True)
        for i in range(3):
            h.submit(f"later{i}", system + [410 + i], {"max_new_tokens": 4, "temperature": 0.0})
        outputs: dict[str, int | None] = {}
        refusals = []

        def on_output(msg):
            outputs.update({o.rid: o.cached_tokens for o in msg.outputs if o.cached_tokens is not None})
            if h.sched.requests:  # requests are running: refused
                refusals.append(h.sched.flush_cache())

        h.io.on_output = on_output
        h.run(overlap=True)
        assert refusals and not any(r.ok for r in refusals) and "running" in refusals[0].message
        assert outputs == {f"later{i}": len(system) for i in range(3)}
        stats = h.sched.stats()
        assert stats.cached_prompt_tokens == 3 * len(system) and stats.kv_evictable > 0
        h.assert_all_free()
    finally:
        h.close()


@pytest.fixture(scope="module")
def stories_32k(stories_path, tmp_path_factory):
    """The embedded model with its context raised to 32768 (positions past 512 were never
    trained, but every request here ends long before)."""
    import json
    import shutil

    path = tmp_path_factory.mktemp("stories32k")
    for f in Path(stories_path).iterdir():
        shutil.copy(f, path / f.name)
    cfg = json.loads((path / "config.json").read_text())
    cfg["max_position_embeddings"] = 32768
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


def test_requests_without_max_tokens_share_a_long_context_pool(stories_32k):
    """32K context, a 64K pool, 64 requests without max_tokens (each may grow to the context):
    admitted on an estimate, not the whole context, so at least 32 run at once (reserving the
    context would allow 2); all complete, each with the tokens it gets alone (one in eight is run alone to check)."""
    from transformers import AutoTokenizer

    from batonlm.config import EMBEDDED_MODEL

    tok = AutoTokenizer.from_pretrained(EMBEDDED_MODEL)
    corpus = (Path(EMBEDDED_MODEL).parents[1] / "bench" / "data" / "corpus.txt").read_text()
    lines = [line for line in corpus.splitlines() if line.strip()][:64]
    prompts = [tok(" ".join(line.split()[:12])).input_ids for line in lines]
    # Stories end at a punctuation mark soon: stop there (max_new_tokens is still the context).
    stops = [tok.convert_tokens_to_ids(t) for t in (".", ",", "!", "?")]

    def params(ids):
        return {"temperature": 0.0, "max_new_tokens": 32768 - len(ids), "stop_token_ids": stops}

    h = SchedulerHarness(stories_32k, max_total_tokens=65536)
    try:
        peak = 0

        def on_output(msg):
            nonlocal peak
            peak = max(peak, h.sched.stats().num_running)

        h.io.on_output = on_output
        for i, ids in enumerate(prompts):
            h.submit(f"r{i}", ids, params(ids))
        together = h.run(overlap=True)
        h.io.on_output = None
        assert peak >= 32, peak
        assert all(r.finish_reason == "stop" for r in together.values())
        h.assert_all_free()
        for i in range(0, len(prompts), 8):  # one in eight alone (each alone is a run of its own)
            h.submit(f"r{i}", prompts[i], params(prompts[i]))
            alone = h.run(overlap=True)[f"r{i}"]
            assert alone.token_ids == together[f"r{i}"].token_ids, f"r{i}"
    finally:
        h.close()


def test_lpm_over_a_running_scheduler_never_starves(stories_path):
    """A request with nothing cached, behind a stream of cache hits: without an age bound it is
    admitted last; with one it goes in once it has waited that many iterations."""
    import dataclasses

    h = SchedulerHarness(stories_path, schedule_policy="lpm", max_running_requests=2)
    try:
        shared = [1] + list(range(300, 340))
        finished_order = {}
        for bound in (10**9, 5):
            h.sched.planner.config = dataclasses.replace(h.sched.planner.config, age_bound=bound)
            h.submit("warm", shared + [7], {"max_new_tokens": 2, "temperature": 0.0})
            h.run(overlap=True)
            h.submit("cold", [1, 450, 451, 452], {"max_new_tokens": 2, "temperature": 0.0, "ignore_eos": True})
            for i in range(30):
                h.submit(f"hit{i}", shared + [8 + i], {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True})
            order: list[str] = []
            h.io.on_output = lambda msg, order=order: order.extend(o.rid for o in msg.outputs if o.finish_reason)
            records = h.run(overlap=True)
            h.io.on_output = None
            assert len(records) == 31 and all(r.finish_reason == "length" for r in records.values())
            finished_order[bound] = order.index("cold")
            h.assert_all_free()
        assert finished_order[10**9] == 30  # last: every hit went first
        assert finished_order[5] < 10  # the age bound let it in early
    finally:
        h.close()
