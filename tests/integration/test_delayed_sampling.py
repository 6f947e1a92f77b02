"""The delayed-sampling hook: sampling launched after the previous result was processed."""

import pytest
from helpers import SchedulerHarness

PROMPTS = [[1, 403, 407, 261, 378], [1, 403], [1, 300, 301, 302]]
PARAMS = {"max_new_tokens": 30, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def harness(stories_path):
    h = SchedulerHarness(stories_path)
    yield h
    h.close()


def _run(h, overlap):
    for i, ids in enumerate(PROMPTS):
        h.submit(f"r{i}", ids, PARAMS, at=i)
    out = {k: v.token_ids for k, v in h.run(overlap=overlap).items()}
    h.assert_all_free()
    return out


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_delayed_sampling_matches_immediate_and_applies_masks(harness, overlap):
    baseline = _run(harness, overlap)
    banned = baseline["r0"][1]  # a token greedy decoding emits
    calls = []
    harness.sched.needs_delayed_sampling = lambda batch: True

    def masks(batch):
        calls.append(batch.batch_id)
        return {}

    harness.sched.sampling_masks = masks
    try:
        assert _run(harness, overlap) == baseline
        assert calls, "the hook was never asked for masks"
        harness.sched.sampling_masks = lambda batch: {row: [banned] for row in range(len(batch))}
        masked = _run(harness, overlap)
    finally:
        del harness.sched.needs_delayed_sampling, harness.sched.sampling_masks
    assert all(banned not in ids for ids in masked.values())
    assert masked["r0"][0] == baseline["r0"][0] and masked["r0"] != baseline["r0"]
