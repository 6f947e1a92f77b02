"""The overlap loop produces exactly what the normal loop produces, and frees everything."""

import random

import pytest
from helpers import SchedulerHarness


@pytest.fixture(scope="module")
def harness(stories_path):
    h = SchedulerHarness(stories_path, max_running_requests=16)
    yield h
    h.close()


STORY = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One day,"
    " she saw a big, red ball. She wanted to play with it, but it was too high. Lily asked her mom for help."
    " Her mom smiled and lifted her up. Lily got the ball and they played together all day. The end."
)


@pytest.fixture(scope="module")
def story_ids(stories_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(stories_path)(STORY).input_ids


def _workload(story_ids, seed: int, sampled: bool):
    """32 requests: story prefixes of random length (so some stories end on EOS), random
    max_new_tokens, random arrival iterations."""
    rng = random.Random(seed)
    reqs = []
    for i in range(32):
        # Every fourth prompt is the whole story or nearly: the model ends it with EOS at once.
        cut = len(story_ids) - rng.randint(0, 2) if i % 4 == 0 else rng.randint(1, len(story_ids))
        ids = story_ids[:cut]
        params = {"max_new_tokens": rng.choice([1, 2, rng.randint(3, 40), rng.randint(40, 160)])}
        if sampled:
            params.update(temperature=rng.choice([0.0, 0.7, 1.0, 1.3]), seed=rng.randrange(2**63))
            params.update(top_k=rng.choice([-1, 5, 40]), top_p=rng.choice([1.0, 0.9, 0.5]))
        else:
            params["temperature"] = 0.0
        reqs.append((f"r{i}", ids, params, rng.randint(0, 60)))
    return reqs


def _run(h: SchedulerHarness, reqs, overlap: bool):
    for rid, ids, params, at in reqs:
        h.submit(rid, ids, params, at=at)
    records = h.run(overlap=overlap)
    h.assert_all_free()
    return records


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded-sampling"])
def test_overlap_equals_normal(harness, story_ids, sampled):
    reqs = _workload(story_ids, seed=11 if sampled else 5, sampled=sampled)
    dropped = harness.sched.dropped_tokens
    normal = _run(harness, reqs, overlap=False)
    assert harness.sched.dropped_tokens == dropped, "the normal loop never runs a finished request"
    overlap = _run(harness, reqs, overlap=True)
    # The overlap loop did run requests one step past their EOS, and dropped those tokens.
    assert harness.sched.dropped_tokens > dropped
    # With consecutive-prefill overlap disabled, the loop processes before launching; same tokens.
    harness.sched.disable_consecutive_prefill_overlap = True
    try:
        switched = _run(harness, reqs, overlap=True)
    finally:
        harness.sched.disable_consecutive_prefill_overlap = False
    assert {k: v.token_ids for k, v in switched.items()} == {k: v.token_ids for k, v in normal.items()}
    assert set(normal) == set(overlap) == {r[0] for r in reqs}
    for rid, _ids, params, _ in reqs:
        n, o = normal[rid], overlap[rid]
        assert o.token_ids == n.token_ids, f"{rid}: overlap {o.token_ids} != normal {n.token_ids}"
        assert o.finish_reason == n.finish_reason
        # The one-step overrun never leaks: nothing after a stop token or past max_new_tokens.
        assert len(o.token_ids) <= params["max_new_tokens"]
        if o.finish_reason == "stop":
            assert o.token_ids[-1] in (1, 2) and not set(o.token_ids[:-1]) & {1, 2}
        else:
            assert o.finish_reason == "length" and len(o.token_ids) == params["max_new_tokens"]
    # The workload must exercise both ways of finishing, or the overrun is not tested.
    reasons = {r.finish_reason for r in overlap.values()}
    assert reasons == {"stop", "length"}


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_abort_half_mid_decode_frees_all_slots(harness, overlap):
    rng = random.Random(3)
    rids = [f"a{i}" for i in range(16)]
    victims = set(rids[::2])
    for rid in rids:
        ids = [1] + [rng.randrange(3, 512) for _ in range(rng.randint(1, 60))]
        harness.submit(rid, ids, {"max_new_tokens": 60, "temperature": 0.0, "ignore_eos": True})
    seen: dict[str, int] = {}

    def on_output(msg):
        for out in msg.outputs:
            seen[out.rid] = seen.get(out.rid, 0) + len(out.token_ids)
            if out.rid in victims and seen[out.rid] == 5:
                harness.abort(out.rid)

    harness.io.on_output = on_output
    try:
        records = harness.run(overlap=overlap)
    finally:
        harness.io.on_output = None
    for rid in rids:
        rec = records[rid]
        if rid in victims:
            assert rec.finish_reason == "abort"
            assert 5 <= len(rec.token_ids) < 60
        else:
            assert rec.finish_reason == "length" and len(rec.token_ids) == 60
    harness.assert_all_free()


def test_requests_beyond_running_limit_queue_and_complete(harness):
    """More requests than max_running_requests and than fit at once: all complete, all freed."""
    for i in range(40):
        harness.submit(f"q{i}", [1, 403, 407, 261, 378], {"max_new_tokens": 20, "temperature": 0.0, "ignore_eos": True})
    records = harness.run(overlap=True)
    assert all(len(r.token_ids) == 20 for r in records.values()) and len(records) == 40
    assert len({tuple(r.token_ids) for r in records.values()}) == 1
    assert harness.sched.stats().iterations > 0
    harness.assert_all_free()
