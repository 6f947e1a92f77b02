"""The torch sampling path: greedy, filtering semantics, seeded reproducibility, suppression."""

import math

import pytest
import torch

from batonlm.kernels import sampling as ref
from batonlm.model_runner.sampler import SamplingBatch, TorchSampler


def _batch(b, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0, seeds=None, positions=None, banned=None):
    seeds = seeds if seeds is not None else list(range(b))
    positions = positions if positions is not None else [0] * b
    lo_hi = [ref.split_seed(s) for s in seeds]
    keys = ref.row_keys(
        torch.tensor([x[0] for x in lo_hi]), torch.tensor([x[1] for x in lo_hi]), torch.tensor(positions)
    )

    def full(v, dtype):
        return torch.tensor(v if isinstance(v, list) else [v] * b, dtype=dtype)

    temp = full(temperature, torch.float32)
    draw = ref.DrawBatch(
        temperature=temp,
        top_k=full(top_k, torch.int64),
        top_p=full(top_p, torch.float32),
        min_p=full(min_p, torch.float32),
        keys=keys,
    )
    return SamplingBatch(
        banned=banned if banned is not None else torch.empty(b, 0, dtype=torch.int64),
        draw=None if bool((temp == 0).all()) else draw,
    )


def test_greedy_takes_the_first_maximum():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, -1.0, 5.0, 5.0]])
    assert TorchSampler().sample(logits, _batch(2, temperature=0.0)).token_ids.tolist() == [1, 0]


def test_greedy_and_sampled_rows_mix():
    torch.manual_seed(0)
    logits = torch.randn(4, 100)
    out = TorchSampler().sample(logits, _batch(4, temperature=[0.0, 1.0, 0.0, 1.0], top_k=[-1, 1, -1, -1])).token_ids
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()
    assert out[1] == logits[1].argmax()  # top_k = 1 is greedy whatever the noise


def test_keep_mask_hand_computed():
    p = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25], [0.5, 0.3, 0.15, 0.05]])
    keep = lambda k, tp, mp: ref.keep_mask_reference(  # noqa: E731
        p, torch.tensor(k), torch.tensor(tp, dtype=torch.float32), torch.tensor(mp, dtype=torch.float32)
    ).tolist()
    assert keep([2, 2, -1], [1.0] * 3, [0.0] * 3) == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]]  # ties kept
    # top-p 0.6: smallest prefix with mass >= 0.6 (0.4 + 0.3; 0.5 + 0.3).
    assert keep([-1] * 3, [0.6] * 3, [0.0] * 3) == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]]
    # top-p is relative to the top-k-renormalised mass: top-2 of row 0 is {0.4, 0.3} (mass 0.7);
    # top_p 0.55 needs 0.385 of it, which 0.4 alone gives (0.55 of the full mass would need 0.3 too).
    assert keep([2, -1, -1], [0.55, 1.0, 1.0], [0.0] * 3)[0] == [1, 0, 0, 0]
    assert keep([2, -1, -1], [0.6, 1.0, 1.0], [0.0] * 3)[0] == [1, 1, 0, 0]  # needs 0.42 > 0.4
    # min-p 0.5: keep p >= 0.5 * max.
    assert keep([-1] * 3, [1.0] * 3, [0.5] * 3) == [[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]]


def test_sampling_never_picks_a_filtered_token():
    torch.manual_seed(1)
    logits = torch.randn(64, 300) * 3
    s = TorchSampler()
    for pos in range(20):
        b = _batch(64, temperature=0.8, top_k=10, top_p=0.7, min_p=0.05, positions=[pos] * 64)
        out = s.sample(logits, b).token_ids
        probs = torch.softmax(logits / 0.8, -1)
        keep = ref.keep_mask_reference(probs, b.draw.top_k, b.draw.top_p, b.draw.min_p)
        assert keep[torch.arange(64), out].all()


def test_sampling_frequencies_follow_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    n = 4000
    # One seeded request's draws at n positions, as one batch of n rows (a row draws the same
    # token alone and in any batch: test_seeded_row_draws_the_same_token_alone_and_in_any_batch).
    batch = _batch(n, seeds=[99] * n, positions=list(range(n)))
    counts = torch.bincount(TorchSampler().sample(logits.expand(n, 4), batch).token_ids, minlength=4).float()
    expected = torch.tensor([0.5, 0.3, 0.15, 0.05]) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.27, f"chi-square {chi2:.1f} (3 dof, p = 0.001) for counts {counts.tolist()}"


def test_seeded_row_draws_the_same_token_alone_and_in_any_batch():
    torch.manual_seed(2)
    row = torch.randn(1, 512)
    s = TorchSampler()
    for pos in range(30):
        alone = s.sample(row, _batch(1, seeds=[1234], positions=[pos])).token_ids[0]
        others = torch.randn(16, 512)
        mixed = torch.cat([others[:7], row, others[7:]])
        seeds = list(range(7)) + [1234] + list(range(7, 16))
        in_batch = s.sample(mixed, _batch(17, seeds=seeds, positions=[pos] * 17)).token_ids[7]
        assert alone == in_batch


def test_different_seeds_and_positions_draw_different_noise():
    keys = ref.row_keys(torch.tensor([1, 2, 1]), torch.tensor([0, 0, 0]), torch.tensor([0, 0, 1]))
    u = ref.counter_uniform(keys, 1000)
    assert 0 < float(u.min()) and float(u.max()) < 1
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert abs(float(u.mean()) - 0.5) < 0.03


def test_split_seed_wraps_negative_and_large_seeds():
    assert ref.split_seed(-1) == (0xFFFFFFFF, 0xFFFFFFFF)
    assert ref.split_seed(2**40 + 5) == (5, 2**8)


def test_banned_tokens_are_suppressed():
    logits = torch.tensor([[0.0, 9.0, 1.0], [0.0, 9.0, 1.0]])
    banned = torch.tensor([[1, -1], [-1, -1]])
    out = TorchSampler().sample(logits, _batch(2, temperature=0.0, banned=banned)).token_ids
    assert out.tolist() == [2, 1]


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_scales_the_distribution(temperature):
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    p = torch.softmax(logits / temperature, -1)[0]
    n = 3000
    batch = _batch(n, temperature=temperature, seeds=[5] * n, positions=list(range(n)))  # n positions at once
    counts = torch.bincount(TorchSampler().sample(logits.expand(n, 3), batch).token_ids, minlength=3).float()
    chi2 = float(((counts - p * n) ** 2 / (p * n)).sum())
    assert chi2 < 13.82, f"chi-square {chi2:.1f} (2 dof, p = 0.001)"
    assert math.isclose(float(counts[0] / n), float(p[0]), abs_tol=0.05)
