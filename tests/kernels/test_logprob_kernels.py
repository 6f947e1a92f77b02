"""The logprobs kernel against hand-computed values and its torch reference."""

import math

import pytest
import torch

pytest.importorskip("triton")

from kernel_helpers import interpreted_only  # noqa: E402

from batonlm.kernels import _triton_logprobs  # noqa: E402
from batonlm.kernels.logprobs import logprobs_reference, logprobs_triton  # noqa: E402

pytestmark = interpreted_only
NEG_INF = float("-inf")
BOTH = [logprobs_reference, logprobs_triton]


U = 2.0**-24  # float32 unit roundoff
# Probabilistic rounding-error bounds (Higham & Mary, SIAM J. Sci. Comput. 2019): a sum of n
# terms in float32, in any order, is within LAMBDA * sqrt(n) * U relative error with probability
# at least 1 - 2 exp(-LAMBDA^2 / 2) (~3e-8 for LAMBDA = 6). The worst-case bound, (n - 1) U, is
# reached only by adversarial data, and the order a CPU sums in (vector width: AVX2, AVX-512)
# changes the error, not the bound.
LAMBDA = 6.0


def logprob_tolerance(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """[B, V] bound on |float32 log_softmax(x / T) - exact|: the rounding of x / T and of
    x / T - max (relative U each), the exp of every term (a few U), and the sum of V terms
    (LAMBDA sqrt(V) U relative, i.e. that much absolute after the log)."""
    temp = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).double()
    z = logits.double() / temp[:, None]
    finite = torch.where(z.isinf(), torch.zeros_like(z), z)
    m = finite.max(dim=-1, keepdim=True).values.abs()
    v = logits.shape[-1]
    return U * (4 * (finite.abs() + m) + LAMBDA * math.sqrt(v) + 8)


def assert_same_logprobs(logits, temperature, chosen, top_n, block=None):
    """The kernel's ids equal the reference's; the values of both are within the float32
    error bound of the exact (float64) logprobs; -inf exactly where the exact ones have it."""
    if block is None:
        got = logprobs_triton(logits, temperature, chosen, top_n)
    else:
        got = _triton_logprobs.logprobs(logits, temperature, chosen, top_n, block=block)
    expected = logprobs_reference(logits, temperature, chosen, top_n)
    assert torch.equal(got[1], expected[1])
    temp = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).double()
    exact = torch.log_softmax(logits.double() / temp[:, None], dim=-1)
    bound = logprob_tolerance(logits, temperature)
    for ids, lps in ((chosen[:, None], (got[0][:, None], expected[0][:, None])), (got[1], (got[2], expected[2]))):
        want, tol = exact.gather(1, ids), bound.gather(1, ids)
        for lp in lps:
            assert lp.dtype == torch.float32 and lp.shape == want.shape
            assert torch.equal(lp.isinf(), want.isinf())
            finite = ~want.isinf()
            err = (lp.double() - want).abs()[finite]
            assert bool((err <= tol[finite]).all()), f"error {err.max():.3g} above the bound {tol[finite].min():.3g}"
    return got


def test_the_bound_catches_a_wrong_sum():
    """The tolerance is tight enough to see one missing block of 4096 terms at V = 151936."""
    x = torch.randn(1, 151936, generator=torch.Generator().manual_seed(0)) * 3
    exact = torch.log_softmax(x.double(), dim=-1)
    wrong = x - torch.logsumexp(x[:, 4096:], dim=-1, keepdim=True)
    assert bool(((wrong.double() - exact).abs() > logprob_tolerance(x, torch.ones(1))).all())


@pytest.mark.parametrize("fn", BOTH, ids=["reference", "triton"])
def test_hand_computed(fn):
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [0.0, 2.0, NEG_INF, 4.0]])
    chosen, top_ids, top_lp = fn(logits, torch.tensor([0.0, 2.0]), torch.tensor([2, 0]), 3)
    lse0 = math.log(math.e + 2 * math.e**3 + 1)  # temperature 0 counts as 1
    lse1 = math.log(1 + math.e + math.e**2)  # logits / 2
    assert torch.allclose(chosen, torch.tensor([3 - lse0, 0 - lse1]), atol=1e-6)
    assert top_ids.tolist() == [[1, 2, 0], [3, 1, 0]]  # the tie 3.0 / 3.0 goes to the lower id
    expected = torch.tensor([[3 - lse0, 3 - lse0, 1 - lse0], [2 - lse1, 1 - lse1, 0 - lse1]])
    assert torch.allclose(top_lp, expected, atol=1e-6)


def _awkward_logits(v: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, v, generator=g) * 3
    x[1] = torch.randint(-2, 2, (v,), generator=g).float()  # large groups of equal logprobs
    x[2] = NEG_INF
    x[2, [3, v - 2]] = 0.5  # all -inf but two: the alternatives then run into -inf, in id order
    x[3, v - 1] = 30.0  # the maximum in the partial last block
    return x


@pytest.mark.parametrize("v", [512, 32000, 151936])
@pytest.mark.parametrize("top_n", [0, 1, 5, 20])
def test_kernel_equals_the_reference(v, top_n):
    x = _awkward_logits(v, seed=v)
    temp = torch.tensor([0.7, 0.0, 1.3, 1.0])
    chosen = torch.tensor([0, v // 2, v - 2, v - 1])
    got = assert_same_logprobs(x, temp, chosen, top_n)
    assert got[1].shape == (4, top_n) and got[1].dtype == torch.int64
    if top_n >= 5:
        assert got[1][2].tolist()[:4] == [3, v - 2, 0, 1]


def test_kernel_equals_the_reference_over_small_blocks_and_padded_rows():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 1024, generator=g)
    x[:, 1000:] = 99.0  # padding past the vocabulary: x is a view with row stride 1024
    x = x[:, :1000]
    x[0] = torch.arange(1000).float() / 100  # ascending: every block replaces the whole list
    x[1, ::7] = 5.0  # many equal maxima spread over the blocks
    temp = torch.tensor([1.0, 0.5, 0.0])
    chosen = torch.tensor([999, 7, 0])
    got = assert_same_logprobs(x, temp, chosen, 20, block=128)
    assert got[1][0].tolist() == list(range(999, 979, -1)) and got[1][1].tolist() == list(range(0, 140, 7))


def test_top_n_out_of_range_is_rejected():
    with pytest.raises(ValueError, match="top_n"):
        logprobs_triton(torch.zeros(1, 4), torch.ones(1), torch.zeros(1, dtype=torch.int64), 5)
