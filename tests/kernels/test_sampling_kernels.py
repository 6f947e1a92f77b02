"""The sampling kernels (argmax, keep mask, draw, counter hash) against their torch references,
under the Triton interpreter."""

import pytest
import torch

pytest.importorskip("triton")

from kernel_helpers import CHI2_CRIT, chi_square, filtered_distribution, interpreted_only, keys_for, params  # noqa: E402

from batonlm.kernels import _triton_sampling  # noqa: E402
from batonlm.kernels import sampling as ref  # noqa: E402

pytestmark = interpreted_only
# None a multiple of the interpreter's block (8192); 32000 already spans four blocks, Qwen's
# 151936 (19) is the slow tier's.
VOCABS = [512, 32000, pytest.param(151936, marks=pytest.mark.slow)]
NEG_INF = float("-inf")


def _awkward_logits(v: int, seed: int) -> torch.Tensor:
    """Six rows: random, peaked, many exact ties, all -inf but one, a tie for the maximum in
    different blocks, a tie-heavy row with a -inf half."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, v, generator=g) * 2
    x[1] *= 3
    x[2] = torch.randint(-3, 3, (v,), generator=g).float()
    x[3] = NEG_INF
    x[3, v - 7] = 1.5
    x[4, [5, v // 2, v - 1]] = x[4].max() + 1
    x[5] = torch.randint(0, 4, (v,), generator=g).float() / 2
    x[5, : v // 2] = NEG_INF
    return x


# (temperature, top_k, top_p, min_p) per row of _awkward_logits; row 0 greedy.
ROWS = [
    (0.0, -1, 1.0, 0.0),
    (0.7, 40, 0.9, 0.0),
    (1.0, 5, 0.5, 0.0),  # top-k lands inside a group of ties: all kept
    (1.3, 20, 0.8, 0.1),
    (1.0, -1, 0.95, 0.05),
    (0.8, 10**9, 0.6, 0.0),  # top_k >= V is off
]


def test_counter_hash_is_the_references_bit_for_bit():
    keys = torch.tensor([0, 1, 2**32 - 1, 2047]).long()
    keys = torch.cat([keys, keys_for([12345, -7], [3, 2**20])])
    for v in (1000, 151936):
        assert torch.equal(ref.counter_uniform_triton(keys, v), ref.counter_uniform(keys, v))


def test_uniform_stays_below_one_where_the_24_bit_value_is_maximal():
    # Key 2047 hashes token 357 to h >> 8 = 2**24 - 1, where (n + 0.5) rounds up to 2**24 in
    # float32: unclamped, u = 1 and the race's E = -log(u) = 0 would make the token always win.
    h = ref.mix32(torch.tensor([2047]) ^ ref.token_salts(512, "cpu")[357])
    assert int(h >> 8) == 2**24 - 1
    for uniform in (ref.counter_uniform, ref.counter_uniform_triton):
        u = uniform(torch.tensor([2047]), 512)
        assert float(u[0, 357]) == 1.0 - 2**-24 and float(u.max()) < 1.0 and float(u.min()) > 0.0


@pytest.mark.parametrize("v", VOCABS)
def test_argmax_takes_the_first_maximum_like_torch(v):
    x = _awkward_logits(v, seed=v)
    out = ref.argmax_triton(x)
    assert torch.equal(out, ref.argmax_reference(x))
    assert out[3] == v - 7 and out[4] == 5


def test_argmax_over_blocks_with_a_tail():
    x = torch.randn(4, 1000)
    x[1, [130, 900]] = 50.0  # tie across blocks: the earlier block wins
    x[2] = NEG_INF
    x[2, 999] = 0.0  # the maximum in the partial last block
    x[3] = 1.0  # all equal
    out = _triton_sampling.argmax(x, block=128)
    assert out.tolist() == ref.argmax_reference(x).tolist()
    assert out[1:].tolist() == [130, 999, 0]


def _probs(x: torch.Tensor, temp: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x / torch.where(temp > 0, temp, torch.ones_like(temp))[:, None], dim=-1)


@pytest.mark.parametrize("v", VOCABS)
def test_keep_mask_equals_the_sorting_reference(v):
    x = _awkward_logits(v, seed=v + 1)
    temp, k, p, m = params(ROWS)
    probs = _probs(x, temp)
    keep = ref.keep_mask_triton(probs, k, p, m)
    expected = ref.keep_mask_reference(probs, k, p, m)
    assert torch.equal(keep, expected)
    assert int(keep[3].sum()) == 1 and bool(keep[3, v - 7])
    assert int(keep[2].sum()) > 5  # the whole group of tied maxima


def test_keep_mask_edge_parameters():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 777, generator=g).repeat(7, 1)
    x[:, 100] = x[:, 200] = x[0].max() + 0.5  # two tied maxima
    rows = [
        (1.0, 1, 1.0, 0.0),  # top-1 keeps both tied maxima
        (1.0, 776, 1.0, 0.0),  # all but the smallest
        (1.0, 777, 1.0, 0.0),
        (1.0, -1, 0.0, 0.0),  # top_p 0: only the maxima
        (1.0, -1, 1e-6, 0.0),
        (1.0, -1, 1.0, 1.0),  # min_p 1: only the maxima
        (1.0, 3, 0.999, 0.9),
    ]
    temp, k, p, m = params(rows)
    probs = _probs(x, temp)
    keep = _triton_sampling.keep_threshold(probs, k, p, m, block=128)
    keep = (probs >= keep[:, None]) & (probs > 0)
    assert torch.equal(keep, ref.keep_mask_reference(probs, k, p, m))
    assert keep.sum(1).tolist()[:3] == [2, 776, 777] and keep[3].nonzero().flatten().tolist() == [100, 200]


def test_keep_mask_at_exact_boundaries_hand_computed():
    # Dyadic probabilities make every sum exact, so each threshold sits exactly on a boundary.
    probs = torch.tensor([[0.125, 0.5, 0.125, 0.25, 0.0]]).repeat(6, 1)
    rows = [
        (1.0, -1, 0.75, 0.0),  # 0.5 + 0.25 reaches 0.75 exactly: those two
        (1.0, -1, 0.5, 0.0),  # 0.5 alone reaches 0.5
        (1.0, 3, 1.0, 0.0),  # the 3rd largest is a tie at 0.125: both kept, and never p = 0
        (1.0, 2, 0.5, 0.0),  # top-2 mass 0.75, target 0.375: 0.5 alone
        (1.0, -1, 1.0, 0.5),  # min_p: p >= 0.25
        (1.0, 5, 1.0, 0.0),  # k = V keeps every p > 0
    ]
    _, k, p, m = params(rows)
    expected = [[0, 1, 0, 1, 0], [0, 1, 0, 0, 0], [1, 1, 1, 1, 0], [0, 1, 0, 0, 0], [0, 1, 0, 1, 0], [1, 1, 1, 1, 0]]
    assert ref.keep_mask_triton(probs, k, p, m).int().tolist() == expected
    assert ref.keep_mask_reference(probs, k, p, m).int().tolist() == expected


@pytest.mark.parametrize("v", VOCABS)
def test_sampled_tokens_equal_the_reference(v):
    x = _awkward_logits(v, seed=v + 2)
    temp, k, p, m = params(ROWS)
    for pos in range(2):
        keys = keys_for([11, 22, 33, 44, 55, 66], [pos] * 6)
        out = ref.sample_triton(x, ref.DrawBatch(temp, k, p, m, keys))
        assert out.tolist() == ref.sample_reference(x, ref.DrawBatch(temp, k, p, m, keys)).tolist()
        assert out[0] == x[0].argmax() and out[3] == v - 7


def test_sampled_tokens_equal_the_reference_over_small_blocks_and_padded_rows():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(8, 1100, generator=g) * 2.5
    x[:, 1000:] = 99.0  # padding past the vocabulary: x is a view with row stride 1100
    x = x[:, :1000]
    x[3, 500:] = NEG_INF
    rows = [(0.0, -1, 1.0, 0.0), (0.6, 7, 0.7, 0.0), (1.0, -1, 0.9, 0.0), (1.5, 100, 1.0, 0.02)] * 2
    temp, k, p, m = params(rows)
    keys = keys_for(list(range(8)), [9] * 8)
    out = _triton_sampling.sample(x, temp, k, p, m, keys, block=128)
    assert out.tolist() == ref.sample_reference(x, ref.DrawBatch(temp, k, p, m, keys)).tolist()


def test_greedy_and_sampled_rows_mix_in_one_batch():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(6, 4000, generator=g)
    rows = [(0.0, -1, 1.0, 0.0), (1.0, 1, 1.0, 0.0), (0.0, 50, 0.5, 0.3), (1.0, -1, 1.0, 0.0)] + [(2.0, -1, 1.0, 0.0)] * 2
    temp, k, p, m = params(rows)
    out = ref.sample_triton(x, ref.DrawBatch(temp, k, p, m, keys_for(list(range(6)), [0] * 6)))
    assert out[:3].tolist() == x[:3].argmax(-1).tolist()  # greedy, and top_k = 1
    assert out.tolist() == ref.sample_reference(x, ref.DrawBatch(temp, k, p, m, keys_for(list(range(6)), [0] * 6))).tolist()


def test_a_seeded_row_draws_the_same_token_alone_and_in_a_batch():
    g = torch.Generator().manual_seed(7)
    row = torch.randn(1, 512, generator=g) * 2
    mine = (0.9, 30, 0.9, 0.02)
    for pos in range(6):
        alone = ref.sample_triton(row, ref.DrawBatch(*params([mine]), keys_for([1234], [pos])))
        others = torch.randn(16, 512, generator=g) * 3
        batch = torch.cat([others[:7], row, others[7:]])
        rows = [(1.0 + 0.1 * i, [-1, 5, 50][i % 3], [1.0, 0.8][i % 2], 0.0) for i in range(16)]
        rows.insert(7, mine)
        seeds = list(range(7)) + [1234] + list(range(7, 16))
        in_batch = ref.sample_triton(batch, ref.DrawBatch(*params(rows), keys_for(seeds, [pos] * 17)))
        assert in_batch[7] == alone[0]
        assert alone[0] == ref.sample_reference(row, ref.DrawBatch(*params([mine]), keys_for([1234], [pos])))[0]


LOGITS_8 = [1.2, 0.8, 0.5, 0.2, -0.2, -0.7, -1.1, -1.6]
FREQ_CASES = [
    # (temperature, top_k, top_p, min_p), draws
    ((0.7, 5, 0.8, 0.0), 4000),  # top-p relative to the top-5 mass
    ((1.5, -1, 1.0, 0.2), 4000),
    ((1.0, -1, 0.6, 0.0), 4000),
    ((1.0, -1, 1.0, 0.0), 4000),
]


@pytest.mark.parametrize("case", FREQ_CASES, ids=lambda c: str(c[0]))
def test_sampling_frequencies_follow_the_filtered_distribution(case):
    (t, k, p, m), n = case
    expected = filtered_distribution(LOGITS_8, t, k, p, m)
    logits = torch.tensor([LOGITS_8]).repeat(n, 1)
    # One draw per output position: independent noise from one seed. The statistics run on the
    # torch reference (the interpreter would take a minute per case); the kernel draws exactly the
    # reference's tokens, shown here on the first rows and above on every kind of row.
    draws = ref.DrawBatch(*params([(t, k, p, m)] * n), keys_for([2024] * n, list(range(n))))
    out = ref.sample_reference(logits, draws)
    head = 24
    head_draws = ref.DrawBatch(*params([(t, k, p, m)] * head), keys_for([2024] * head, list(range(head))))
    assert ref.sample_triton(logits[:head], head_draws).tolist() == out[:head].tolist()
    counts = torch.bincount(out, minlength=8).double()
    assert all(c == 0 for c, e in zip(counts.tolist(), expected) if e == 0), counts.tolist()
    stat, dof = chi_square(counts, expected)
    assert stat < CHI2_CRIT[dof], f"chi-square {stat:.1f} ({dof} dof) for {counts.tolist()} vs {expected}"
    # The test has the power to see a kernel that ignored the temperature.
    wrong = filtered_distribution(LOGITS_8, 1.0 if t != 1.0 else 2.0, k, p, m)
    if [e > 0 for e in wrong] == [e > 0 for e in expected]:
        assert chi_square(counts, wrong)[0] > CHI2_CRIT[dof]
