"""DP attention: two replicas whose devices run every MLP together, under seeded random arrival
schedules — every pairing of idle / extend / decode across the ranks happens, nothing deadlocks,
the tokens are the single-process ones, and the ranks take the same overlap decision every
iteration (checked by the sync itself: a difference stops the run)."""

import random

import pytest
from helpers import SchedulerHarness, random_prompts
from tp_jobs import dp_scheduler_job, run_ranks

from batonlm.scheduler.dp_sync import KINDS


def _schedule(seed: int):
    """Requests for two ranks at random iterations: bursts and gaps, so that either rank is idle
    while the other prefills or decodes, and prefills (16-token chunks) meet decodes."""
    rng = random.Random(seed)
    prompts = random_prompts(14, rng, lo=1, hi=90)
    out = []
    for i, ids in enumerate(prompts):
        rank = i % 2
        at = rng.choice([0, 0, 3, 8, 20, 45, 60]) + rng.randint(0, 4) + (30 * rank if rng.random() < 0.3 else 0)
        out.append((f"r{i}", ids, rng.randint(2, 24), at, rank))
    return out


def _single_process_tokens(model, schedule):
    h = SchedulerHarness(model, chunked_prefill_size=16)
    try:
        for rid, ids, n, _at, _ in schedule:
            h.submit(rid, ids, {"temperature": 0.0, "max_new_tokens": n})
        records = h.run(overlap=True)
        return {rid: r.token_ids for rid, r in records.items()}
    finally:
        h.close()


@pytest.mark.parametrize(("model", "overlap", "consecutive_prefill_rule", "seed"),
                         [("stories", True, False, 1), ("stories", True, True, 4),
                          ("stories", False, False, 5), ("deepseek_v2", True, False, 6)],
                         ids=["overlap", "overlap-consecutive-prefill-rule", "normal", "moe-overlap"])
def test_two_replicas_with_dp_attention_match_one_process(
    request, tmp_path, model, overlap, consecutive_prefill_rule, seed
):
    """With a mixture-of-experts model (deepseek_v2: latent attention, a dense first layer, group-
    routed experts and shared experts) the sparse MoE layer is what the ranks run together, each
    holding its share of every expert, and each replica's latent attention its own. One schedule meets every pairing (each of
    seeds 1-12 did; the check below keeps it so for the first)."""
    model_path = request.getfixturevalue("stories_path") if model == "stories" else \
        request.getfixturevalue("tiny_models")[model]
    env = {"BATONLM_DISABLE_CONSECUTIVE_PREFILL_OVERLAP": "1" if consecutive_prefill_rule else "0"}
    pairings = [0] * 9
    schedule = _schedule(seed)
    want = _single_process_tokens(model_path, schedule)
    reports = run_ranks(dp_scheduler_job, 2, model_path, str(tmp_path), schedule, overlap, env, timeout=300)
    got = {}
    iterations = set()
    for records, (pairs, checked, iters) in reports.values():
        got.update(records)
        pairings = [a + b for a, b in zip(pairings, pairs)]
        iterations.add(iters)
        assert checked >= iters - 1  # every iteration's overlap decision was compared
    assert len(iterations) == 1, "the replicas ran different numbers of iterations"
    assert got == want
    if seed == 1:  # the schedule meets every pairing
        cells = {f"{KINDS[m]}/{KINDS[o]}": pairings[m * 3 + o] for m in range(3) for o in range(3)}
        missing = [k for k, v in cells.items() if v == 0 and k != "idle/idle"]
        assert not missing, f"pairings never seen: {missing} ({cells})"


def test_different_overlap_decisions_stop_every_rank():
    from tp_jobs import dp_decision_job

    same = run_ranks(dp_decision_job, 2, [True, True])
    assert all(rep[1] == ("ok", True, 1) for rep in same.values())  # both done: the loops end
    differ = run_ranks(dp_decision_job, 2, [True, False])
    for _, (kind, message, _) in differ.values():
        assert kind == "error" and "different overlap decisions" in message
