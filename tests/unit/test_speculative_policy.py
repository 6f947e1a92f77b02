"""The n-gram index, draft acceptance, the drafting policy and the overlap loop's rule for
speculative batches, and what a verifying request's launch rows look like."""

from __future__ import annotations

import torch

from batonlm.model_runner.spec_verify import accept_drafts
from batonlm.sampling_params import SamplingParams
from batonlm.scheduler.batch import ScheduleBatch
from batonlm.scheduler.overlap_policy import must_process_before_planning
from batonlm.scheduler.request import Request
from batonlm.scheduler.speculative import NgramIndex, SpecConfig, Speculator, expected_tokens


def test_ngram_index_drafts_what_followed_the_latest_longest_match():
    idx = NgramIndex([5, 6, 7, 8, 9, 5, 6, 7], n_min=2, n_max=3)
    assert idx.draft(3) == [8, 9, 5]  # "5 6 7" was followed by 8 9 5
    idx.extend([1, 2, 6, 7])  # now "6 7" ends it; its latest earlier occurrence is followed by 1
    assert idx.draft(2) == [1, 2]
    assert NgramIndex([1, 2, 3], 2, 3).draft(4) == []  # nothing repeats
    # Lag 1: the next token is being computed; its guess is what followed, the drafts come after.
    assert NgramIndex([5, 6, 7, 8, 9, 5, 6], 2, 3).draft(2, lag=1) == [8, 9]


def test_ngram_index_prefers_longer_ngrams_and_the_latest_occurrence():
    idx = NgramIndex([1, 2, 3, 1, 2, 4, 9, 2, 3], n_min=1, n_max=2)
    # "2 3" occurred at 1..2 (followed by 1); the bigram wins over the unigram "3".
    assert idx.draft(1) == [1]
    idx = NgramIndex([7, 1, 7, 2, 7], n_min=1, n_max=1)
    assert idx.draft(1) == [2]  # the latest "7" was followed by 2


def test_accept_drafts_counts_the_leading_matches_and_picks_the_token_after():
    # Group 0: rows 0..3 (inputs 10, 11, 12, 13: newest output, drafts 11 12 13); the rows
    # sampled 11, 12, 99, 5: drafts 11 and 12 accepted, 13 rejected, the token after is 99.
    # Group 1: rows 5..6 (a plain row 4 between); the draft 21 rejected at once: token 7.
    inputs = torch.tensor([10, 11, 12, 13, 50, 20, 21])
    tokens = torch.tensor([11, 12, 99, 5, 51, 7, 8])
    accepted, bonus = accept_drafts(tokens, inputs, [(0, 4), (5, 2)])
    assert accepted.tolist() == [2, 0] and bonus.tolist() == [99, 7]
    all_in, last = accept_drafts(torch.tensor([11, 12, 13, 42]), torch.tensor([10, 11, 12, 13]), [(0, 4)])
    assert all_in.tolist() == [3] and last.tolist() == [42]


def test_expected_tokens():
    assert expected_tokens(0.0, 4) == 1.0 and expected_tokens(1.0, 4) == 5.0
    assert abs(expected_tokens(0.5, 2) - 1.75) < 1e-12


def _req(prompt, outputs, **params) -> Request:
    r = Request("r", list(prompt), SamplingParams(max_new_tokens=50, **params), 0, 512, (2,))
    r.output_ids = list(outputs)
    r.num_outputs_launched = len(outputs) + 1  # this step's output, as the planner counts it
    return r


def test_the_policy_drafts_when_it_pays_and_skips_who_cannot_draft():
    spec = Speculator(SpecConfig(num_draft_tokens=3, cost_ratio=0.0))
    rep = _req([1, 5, 6, 7, 8, 5, 6], [7])
    penalized = _req([1, 5, 6, 7, 8, 5, 6], [7], frequency_penalty=0.5)
    assert spec.plan([rep, penalized]) == [[8, 5, 6], []]
    # A draft that does not pay (each draft costs more than it is expected to return) pauses.
    costly = Speculator(SpecConfig(num_draft_tokens=3, cost_ratio=10.0))
    r = _req([1, 5, 6, 7, 8, 5, 6], [7])
    assert costly.plan([r]) == [[]] and r.spec.pause == 1
    # Near max_new_tokens: the drafts and the token after them must fit.
    short = _req([1, 5, 6, 7, 8, 5, 6], [7])
    short.max_new_tokens = short.num_outputs_launched + 1
    assert spec.plan([short]) == [[8]]


def test_verification_outcomes_adapt_the_draft_length():
    spec = Speculator(SpecConfig(num_draft_tokens=4, cost_ratio=0.0))
    r = _req([1, 5, 6, 7, 8, 5, 6], [7])
    spec.plan([r])
    spec.verified(r, drafted=3, accepted=3)
    assert r.spec.k == 4 and spec.stats.hist[3] == 1
    spec.verified(r, drafted=4, accepted=1)
    assert r.spec.k == 2 and r.spec.rate < 1.0
    assert spec.stats.steps == 2 and spec.stats.accepted == 4 and spec.stats.drafted == 7


def test_a_speculative_batch_is_processed_before_the_next_is_planned():
    verify = ScheduleBatch(0, is_speculative=True)
    assert must_process_before_planning(verify)
    assert not must_process_before_planning(ScheduleBatch(1))
    assert not must_process_before_planning(None)


def test_a_verifying_request_launches_one_decode_row_per_position():
    prompt = [1, 5, 6, 7, 8, 5, 6]
    known = _req(prompt, [7])  # its newest output (7, position 7) was processed
    known.req_slot, known.kv_slots = 3, list(range(100, 111))
    known.kv_len = 11  # positions 7..10: the newest output and 3 drafts
    inflight = _req(prompt, [7])
    inflight.num_outputs_launched = 3
    inflight.req_slot, inflight.kv_slots, inflight.kv_len = 4, list(range(200, 212)), 11  # position 8 in flight
    plain = _req(prompt, [7])
    plain.req_slot, plain.kv_slots, plain.kv_len = 5, list(range(300, 308)), 8
    batch = ScheduleBatch(0, decode=[known, inflight, plain], drafts=[[8, 5, 6], [9, 9], []])
    launch = batch.to_launch()
    assert launch.req_slots == [3, 3, 3, 3, 4, 4, 4, 5]
    assert launch.prefix_lens == [7, 8, 9, 10, 8, 9, 10, 7] and launch.extend_lens == [1] * 8
    assert launch.verify_groups == [(0, 4), (4, 3)] and batch.launch_rows == [0, 4, 7]
    # Known inputs come from the host; an input still being computed comes from the FutureMap.
    assert launch.from_future == [False, False, False, False, True, False, False, True]
    assert launch.input_ids == [7, 8, 5, 6, 9, 9]
    assert launch.out_cache_loc == [107, 108, 109, 110, 208, 209, 210, 307]


def test_server_args_name_a_bad_speculative_setting():
    import pytest

    from batonlm.config import ConfigError, ServerArgs

    for kwargs, field in (({"speculative_algorithm": "eagle"}, "speculative_algorithm"),
                          ({"speculative_num_draft_tokens": 0}, "speculative_num_draft_tokens"),
                          ({"speculative_ngram_min": 3, "speculative_ngram_max": 2}, "speculative_ngram_max"),
                          ({"speculative_disable_batch_size": -1}, "speculative_disable_batch_size"),
                          ({"speculative_algorithm": "draft"}, "speculative_draft_model"),
                          ({"speculative_draft_model": "some/dir"}, "speculative_draft_model"),
                          ({"speculative_cost_ratio": -1.0}, "speculative_cost_ratio")):
        with pytest.raises(ConfigError) as e:
            ServerArgs(**kwargs)
        assert e.value.field == field


def test_constrained_requests_draft_ngrams_but_not_from_a_draft_model():
    r = _req([1, 5, 6, 7, 8, 5, 6], [7])
    r.matcher = object()  # a compiled grammar's matcher
    assert Speculator(SpecConfig(cost_ratio=0.0)).plan([r]) == [[8, 5, 6, 7]]
    r2 = _req([1, 5, 6, 7, 8, 5, 6], [7])
    r2.matcher = object()
    assert Speculator(SpecConfig(cost_ratio=0.0, draft_model=True)).plan([r2]) == [[]]
    free = _req([1, 5], [7])
    assert Speculator(SpecConfig(num_draft_tokens=2, cost_ratio=0.0, draft_model=True)).plan([free]) == [[-1, -1]]
