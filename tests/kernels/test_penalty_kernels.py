"""The fused penalties kernel against hand-computed values and its torch reference."""

import pytest
import torch

pytest.importorskip("triton")

from kernel_helpers import flat_penalties, interpreted_only  # noqa: E402

from batonlm.kernels import _triton_penalties  # noqa: E402
from batonlm.kernels.penalties import (  # noqa: E402
    PenaltyBatch,  # noqa: E402
    apply_penalties_reference,
    apply_penalties_triton,
    prompt_mask_row,
    reset_slot,
    update_output_counts,
)

reference_flat, triton_flat = flat_penalties(apply_penalties_reference), flat_penalties(apply_penalties_triton)

pytestmark = interpreted_only
NEG_INF = float("-inf")
BOTH = [reference_flat, triton_flat]


def _f32(values):
    return torch.tensor(values, dtype=torch.float32)


@pytest.mark.parametrize("apply", BOTH, ids=["reference", "triton"])
def test_tiny_vocabulary_hand_computed(apply):
    logits = _f32([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0], [2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    counts = torch.zeros(3, 6, dtype=torch.int32)
    counts[2, 0] = 2  # slot 2 generated token 0 twice and token 4 once
    counts[2, 4] = 1
    prompt = torch.zeros(3, 6, dtype=torch.bool)
    prompt[2, 1] = True  # ... and had token 1 in its prompt
    out = apply(
        logits,
        torch.tensor([2, 0]),
        counts,
        prompt,
        _f32([0.5, 0.0]),  # frequency
        _f32([0.25, 0.0]),  # presence
        _f32([2.0, 1.0]),  # repetition
        torch.tensor([[3, 5], [2, -1]]),  # logit bias ids
        _f32([-4.0, 1.5, 7.0, 9.0]).view(2, 2),
        torch.tensor([[5, -1], [-1, -1]]),  # banned
    )
    expected_0 = [
        2.0 / 2 - (0.5 * 2 + 0.25),  # output token, positive: divided, then frequency and presence
        -1.0 * 2,  # prompt token, negative: multiplied, no frequency/presence
        0.5,  # untouched
        3.0 - 4.0,  # bias only (not seen)
        -2.0 * 2 - (0.5 * 1 + 0.25),
        NEG_INF,  # biased, then banned
    ]
    assert out[0].tolist() == expected_0
    assert out[1].tolist() == [2.0, -1.0, 0.5 + 7.0, 3.0, -2.0, 1.0]  # slot 0: bias only
    assert logits[0, 0] == 2.0  # the input is left alone


@pytest.mark.parametrize("apply", BOTH, ids=["reference", "triton"])
def test_bias_decides_the_sign_the_repetition_penalty_sees(apply):
    # (a) before (b): a negative logit biased to positive is divided, not multiplied.
    counts = torch.zeros(1, 4, dtype=torch.int32)
    counts[0, 1] = 1
    out = apply(
        _f32([[0.0, -1.0, 0.0, 0.0]]), torch.tensor([0]), counts, torch.zeros(1, 4, dtype=torch.bool),
        _f32([0.0]), _f32([0.0]), _f32([2.0]), torch.tensor([[1]]), _f32([[3.0]]), torch.full((1, 0), -1),
    )
    assert out[0, 1] == (-1.0 + 3.0) / 2.0


def _random_case(v: int, b: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    num_slots = b + 3
    logits = torch.randn(b, v, generator=g) * 4
    logits[0, : v // 3] = NEG_INF
    counts = torch.randint(0, 4, (num_slots, v), generator=g, dtype=torch.int32)
    counts *= (torch.rand(num_slots, v, generator=g) < 0.02).int()
    prompt = torch.rand(num_slots, v, generator=g) < 0.03
    slots = torch.randperm(num_slots, generator=g)[:b]
    nb = 9
    bias_ids = torch.stack([torch.randperm(v, generator=g)[:nb] for _ in range(b)])
    bias_ids[:, -1] = v - 1  # the last token, in the partial last block
    bias_ids[1, 3:] = -1
    bias_values = torch.randn(b, nb, generator=g) * 5
    banned = torch.stack([torch.randperm(v, generator=g)[:3] for _ in range(b)])
    banned[0, 0] = bias_ids[0, 0]
    banned[-1] = -1
    pen = [torch.rand(b, generator=g) * 2 - 0.5, torch.rand(b, generator=g) * 2 - 0.5, torch.rand(b, generator=g) + 0.5]
    pen[2][1] = 1.0
    return logits, slots, counts, prompt, *pen, bias_ids, bias_values, banned


@pytest.mark.parametrize("v", [512, 32000, 151936])
def test_kernel_equals_the_reference(v):
    args = _random_case(v, 3, seed=v)
    out = triton_flat(*args)
    assert torch.equal(out, reference_flat(*args))
    assert out[0, : v // 3].eq(NEG_INF).all()


def test_kernel_equals_the_reference_over_small_blocks_and_padded_rows():
    args = list(_random_case(1000, 4, seed=1))
    wide = torch.full((4, 1024), 99.0)  # logits as a view of a padded vocabulary: row stride 1024
    wide[:, :1000] = args[0]
    args[0] = wide[:, :1000]
    out = _triton_penalties.apply(*args, block=128)
    assert out.shape == (4, 1000) and torch.equal(out, reference_flat(*args))


def test_no_penalties_change_nothing():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 700, generator=g)
    counts = torch.randint(0, 3, (2, 700), generator=g, dtype=torch.int32)
    zeros = torch.zeros(2)
    out = apply_penalties_triton(logits, PenaltyBatch(torch.tensor([1, 0]), counts, counts > 1, zeros, zeros, torch.ones(2), torch.full((2, 3), -1), torch.zeros(2, 3)), torch.full((2, 2), -1))
    assert torch.equal(out, logits)


def test_repeated_bias_ids_add_up():
    args = list(_random_case(300, 3, seed=3))
    args[7] = torch.tensor([[5, 5, 9], [7, -1, 7], [-1, -1, -1]])
    args[8] = _f32([[1.0, 2.0, -1.0], [0.5, 9.0, 0.25], [0.0, 0.0, 0.0]])
    out = triton_flat(*args)
    torch.testing.assert_close(out, reference_flat(*args), rtol=1e-6, atol=1e-6)


def test_output_counts_and_prompt_mask_rows():
    counts = torch.zeros(3, 10, dtype=torch.int32)
    update_output_counts(counts, torch.tensor([2, 0]), torch.tensor([4, 9]))
    update_output_counts(counts, torch.tensor([2, 1]), torch.tensor([4, -1]))  # -1: nothing sampled
    assert counts[2, 4] == 2 and counts[0, 9] == 1 and int(counts.sum()) == 3
    assert prompt_mask_row([1, 3, 3], 5, "cpu").tolist() == [False, True, False, True, False]
    mask = torch.ones(3, 10, dtype=torch.bool)
    reset_slot(counts, mask, 2, [0, 7])
    assert int(counts[2].sum()) == 0 and mask[2].nonzero().flatten().tolist() == [0, 7] and bool(mask[0].all())
