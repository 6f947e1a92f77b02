"""SlotSamplingTable: a request's record written once, gathered per batch into sampler inputs."""

import torch

from batonlm.ipc.device_messages import SlotSampling
from batonlm.kernels import sampling as ref
from batonlm.model_runner.sampling_table import SlotSamplingTable
from batonlm.sampling_params import LogitChanges, SamplingParams

V = 50


def record(slot, params, *, seed=1, stop_ids=(), prompt=(3, 4, 5), outputs=()):
    pen = params.counts_tokens  # only counted penalties need the prompt and the outputs
    return SlotSampling(slot, params, seed, sorted(stop_ids), len(prompt), list(prompt) if pen else [],
                        list(outputs) if pen else [])


def t(xs):
    return torch.tensor(xs, dtype=torch.int64)


def test_an_all_greedy_batch_gathers_no_draw_inputs():
    table = SlotSamplingTable(4, V, "cpu")
    table.init_slot(record(0, SamplingParams(temperature=0.0)))
    table.init_slot(record(1, SamplingParams(top_k=1, temperature=0.9)))  # top-k 1 is greedy too
    batch = table.gather(t([0, 1]), t([3, 4]), all_greedy=True)
    assert batch.draw is None and batch.penalties is None and batch.banned.shape == (2, 0)


def test_draw_inputs_per_row_with_keys_from_seed_and_output_position():
    table = SlotSamplingTable(4, V, "cpu")
    table.init_slot(record(2, SamplingParams(temperature=0.5, top_k=10**6, top_p=0.9, min_p=0.1), seed=-5))
    table.init_slot(record(0, SamplingParams(temperature=0.0, top_k=0)))
    batch = table.gather(t([2, 0]), t([7, 4]), all_greedy=False)
    d = batch.draw
    assert d.temperature.tolist() == [0.5, 0.0]
    assert d.top_k.tolist() == [V, -1]  # clamped to the vocabulary; 0 means off
    assert torch.allclose(d.top_p, torch.tensor([0.9, 1.0])) and torch.allclose(d.min_p, torch.tensor([0.1, 0.0]))
    # Output positions: 7 - 3 = 4 for slot 2, 4 - 3 = 1 for slot 0 (both prompts have 3 tokens).
    (lo2, hi2), (lo0, hi0) = ref.split_seed(-5), ref.split_seed(1)
    assert d.keys.tolist() == ref.row_keys(t([lo2, lo0]), t([hi2, hi0]), t([4, 1])).tolist()


def test_stop_ids_are_banned_only_while_under_min_new_tokens():
    table = SlotSamplingTable(2, V, "cpu")
    table.init_slot(record(0, SamplingParams(min_new_tokens=2), stop_ids=[2, 9]))
    table.init_slot(record(1, SamplingParams(), stop_ids=[2]))  # no minimum: nothing banned
    for seq_len, banned0 in ((3, [2, 9]), (4, [2, 9]), (5, [-1, -1])):
        banned = table.gather(t([0, 1]), t([seq_len, seq_len]), all_greedy=True).banned
        assert banned.tolist() == [banned0, [-1, -1]]


def test_penalty_state_follows_the_slot_and_is_reset_for_its_next_request():
    table = SlotSamplingTable(3, V, "cpu")
    p = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5, logit_bias={7: 2.0, 11: -1.0})
    table.init_slot(record(1, p, prompt=(4, 5)))
    table.init_slot(record(0, SamplingParams(presence_penalty=0.25, logit_bias={3: 1.0})))
    batch = table.gather(t([1, 0]), t([2, 3]), all_greedy=True, logit_changes=LogitChanges.COUNTED)
    pen = batch.penalties
    assert pen.repetition.tolist() == [1.5, 1.0] and pen.frequency.tolist() == [0.5, 0.0]
    assert pen.presence.tolist() == [0.0, 0.25]
    assert pen.bias_ids.tolist() == [[7, 11], [3, -1]] and pen.bias_values.tolist() == [[2.0, -1.0], [1.0, 0.0]]
    assert table.prompt_mask[1].nonzero().flatten().tolist() == [4, 5]
    table.record_outputs(t([1, 0]), t([9, 9]))
    table.record_outputs(t([1]), t([9]))
    assert table.output_counts[1, 9] == 2 and table.output_counts[0, 9] == 1
    # Slot 1's next request has no bias and another prompt: nothing of the last one remains.
    table.init_slot(record(1, SamplingParams(frequency_penalty=1.0), prompt=(6,)))
    pen = table.gather(t([1]), t([1]), all_greedy=True, logit_changes=LogitChanges.COUNTED).penalties
    assert pen.bias_ids.tolist() == [[-1, -1]] and int(table.output_counts[1].sum()) == 0
    assert table.prompt_mask[1].nonzero().flatten().tolist() == [6]


def test_a_resumed_request_gets_its_output_counts_back():
    """After a retraction, the record carries the outputs so far: the penalties count them."""
    table = SlotSamplingTable(2, V, "cpu")
    table.init_slot(record(1, SamplingParams(frequency_penalty=1.0), prompt=(3, 4), outputs=(9, 9, 12)))
    assert table.output_counts[1, 9] == 2 and table.output_counts[1, 12] == 1
    assert int(table.output_counts[1].sum()) == 3


def test_logit_bias_alone_is_added_without_the_count_tables():
    """Bias without penalties allocates no [slots, V] tables and samples as the fused pass would:
    the same logits as apply_penalties_reference with zero penalties (one add per id)."""
    from batonlm.kernels.penalties import PenaltyBatch, add_logit_bias, apply_penalties_reference
    from batonlm.model_runner.sampler import TorchSampler

    table = SlotSamplingTable(3, V, "cpu")
    table.init_slot(record(2, SamplingParams(logit_bias={7: 2.5, 0: -100.0, 49: 0.75})))
    table.init_slot(record(0, SamplingParams(logit_bias={3: 1.0})))  # padded: one id of three
    assert table.output_counts is None and table.prompt_mask is None
    batch = table.gather(t([2, 0]), t([4, 4]), all_greedy=True, logit_changes=LogitChanges.BIAS)
    assert batch.penalties is None and batch.bias is not None
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(3))
    logits[1, 3] = logits[1].max() - 0.5  # the bias of 1.0 makes id 3 row 1's argmax
    zeros = torch.zeros(3, V)
    fused = apply_penalties_reference(logits, PenaltyBatch(
        t([2, 0]), zeros.int(), zeros.bool(), torch.zeros(2), torch.zeros(2), torch.ones(2), *batch.bias), batch.banned)
    assert torch.equal(add_logit_bias(logits, *batch.bias), fused) and fused[0, 0] == logits[0, 0] - 100
    ids = TorchSampler().sample(logits, batch).token_ids.tolist()
    assert ids == fused.argmax(-1).tolist() and ids[1] == 3 and ids != logits.argmax(-1).tolist()
