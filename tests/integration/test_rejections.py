"""Requests that can never be served are rejected with the numbers; the loop keeps serving."""

import pytest
from helpers import SchedulerHarness

GOOD = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_too_long_and_never_fitting_requests_are_rejected(stories_path, overlap):
    h = SchedulerHarness(stories_path, max_total_tokens=300)
    try:
        h.submit("good0", [1, 403, 407], GOOD)
        h.submit("too_long", [1] + [300] * 599, GOOD, at=1)  # 600 tokens, context 512
        h.submit("never_fits", [1] + [300] * 199, {"max_new_tokens": 200}, at=1)  # needs 399 > 300
        h.submit("bad_ids", [1, 512, 9999], GOOD, at=2)
        h.submit("empty", [], GOOD, at=2)
        h.submit("good1", [1, 403, 407, 261], GOOD, at=2)
        records = h.run(overlap=overlap)
        long = records["too_long"]
        assert long.finish_reason == "abort" and long.token_ids == []
        assert "600" in long.error and "512" in long.error
        never = records["never_fits"]
        assert never.finish_reason == "abort" and never.token_ids == []
        assert "399" in never.error and "300" in never.error
        assert "512" in records["bad_ids"].error and "9999" in records["bad_ids"].error
        assert "empty" in records["empty"].error
        for rid in ("good0", "good1"):
            assert records[rid].finish_reason == "length" and len(records[rid].token_ids) == 16
        h.assert_all_free()
    finally:
        h.close()


def test_requests_beyond_the_pool_are_retracted_and_resume_unchanged(stories_path):
    """Four requests that each fit the pool (199 slots of 300) but not two at a time: admitted
    optimistically, retracted when the pool runs out, resumed from prompt + outputs; each ends
    with the tokens it produces alone."""
    h = SchedulerHarness(stories_path, max_total_tokens=300)
    try:
        params = {"max_new_tokens": 100, "temperature": 0.0, "ignore_eos": True}
        prompts = {f"r{i}": [1] + [300 + i] * 99 for i in range(4)}
        alone = {}
        for rid, ids in prompts.items():
            h.submit(rid, ids, params)
            alone.update(h.run(overlap=True))
        h.assert_all_free()
        for rid, ids in prompts.items():
            h.submit(rid, ids, params)
        records = h.run(overlap=True)
        assert {k: v.token_ids for k, v in records.items()} == {k: v.token_ids for k, v in alone.items()}
        assert all(len(r.token_ids) == 100 for r in records.values())
        assert h.sched.stats().retractions > 0
        h.assert_all_free()
    finally:
        h.close()
