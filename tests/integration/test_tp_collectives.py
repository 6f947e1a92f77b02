"""Tensor-parallel ranks over gloo: the collectives a forward issues, the launch relay and its
heartbeat, the divergence check, and logits that agree with one rank's."""

import pytest
import torch
from tp_jobs import agreement_job, forward_job, relay_job, run_ranks

from batonlm.model_runner.model_config import ModelConfig


@pytest.mark.parametrize("size", [2])  # (4 ranks: the same counts; the token tests run 4)
def test_a_forward_issues_the_designed_collectives_and_matches_one_rank(stories_path, size):
    cfg = ModelConfig.from_hf(stories_path)
    single = run_ranks(forward_job, 1, stories_path)[0]
    reports = run_ranks(forward_job, size, stories_path)
    for rank, (counts, logits) in reports.items():
        # Per forward: the embedding's all-reduce, o_proj's and down_proj's per layer; one
        # all-gather of the LM head's logits.
        assert counts == [(2 * cfg.num_layers + 1, 1)] * 2, (rank, counts)
        assert logits == reports[0][1], f"rank {rank}'s logits differ from rank 0's"
    assert single[0] == [(0, 0)] * 2  # one rank: no collective at all
    for got, want in zip(reports[0][1], single[1]):
        got, want = torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64)
        # Only the order of the sums differs (row-parallel partial sums): a few float32 ulps of
        # the largest logit per layer, 64 of them, is a generous bound.
        tol = 64 * torch.finfo(torch.float32).eps * want.abs().max() * cfg.num_layers
        assert (got - want).abs().max() <= tol
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_the_relay_delivers_every_message_and_heartbeat_in_order():
    from batonlm.distributed.relay import FRAME_BYTES

    # One that fits the frame, one that does not (a second broadcast), one that fits exactly.
    messages = [b"launch one", bytes(range(256)) * 40, b"x" * (FRAME_BYTES - 16)]
    reports = run_ranks(relay_job, 3, messages)
    for rank in (1, 2):
        got, (msgs, beats, broadcasts) = reports[rank]
        assert got == [m for pair in zip(messages, [None] * 3) for m in pair]
        assert (msgs, beats) == (3, 3)
        assert broadcasts == 3 + 1 + 3  # a frame per message (+ the long one's payload), a frame per heartbeat
    assert reports[0][1][:2] == (3, 3)


def test_the_divergence_check_names_the_ranks_that_differ():
    assert all(err is None for _, err in run_ranks(agreement_job, 3, [5, 5, 5]).values())
    reports = run_ranks(agreement_job, 3, [5, 5, 6])
    for _, err in reports.values():
        assert err is not None and "ranks [2] differ from rank 0 at batch 7" in err
