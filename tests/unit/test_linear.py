"""The projections' matmul (batonlm/model_runner/linear.py): the compiled CPU reduction at one
row (F.linear at more), and oneDNN's packed weights (float32, bfloat16) eager and inside
torch.compile, each against a float64 product.

Tolerance from the math: a float32 dot product of length K, in any summation order, is within
K * u * sum_k |x_k w_k| of the exact one (u = 2^-24), plus the rounding of the result."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from batonlm.model_runner import linear as lin
from batonlm.model_runner.linear import Linear, linear, pack

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN is missing")

K, N = 96, 40


def _assert_product(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    bound = K * 2.0**-24 * (x.double().abs() @ w.double().abs().T) + 2.0**-23 * exact.abs() + 1e-30
    err = (y.double() - exact).abs()
    assert y.shape == exact.shape
    assert (err <= bound).all(), f"max error {err.max():.3g} over a bound of {bound[err > bound].min():.3g}"


@pytest.fixture
def weights():
    torch.manual_seed(0)
    w, b = torch.randn(N, K), torch.randn(N)
    yield w, b
    lin.unpack([w])


@pytest.mark.parametrize("rows", [1, 3])
def test_compiled_reduction_is_the_product(weights, rows: int) -> None:
    w, b = weights
    step = torch.compile(lambda x: linear(x, w, b), dynamic=False, fullgraph=True)
    x = torch.randn(rows, K)
    _assert_product(step(x), x, w, b)
    # A 3-D input keeps its leading dims.
    x3 = torch.randn(1, rows, K)
    assert step(x3).shape == (1, rows, N)


def test_packed_weights_eager_and_compiled(weights) -> None:
    w, b = weights
    assert pack([w], min_elements=0) == w.numel() * 4
    for rows in (1, 16, 33):
        x = torch.randn(rows, K)
        y = linear(x, w, b)
        _assert_product(y, x, w, b)
        # Through oneDNN, not F.linear: the op sees the packed twin.
        assert lin._packed.get(lin._key(w)) is not None
    step = torch.compile(lambda x: linear(x, w, None), dynamic=False, fullgraph=True)
    x = torch.randn(16, K)
    _assert_product(step(x), x, w, None)


def test_an_unpacked_weight_takes_f_linear_and_a_freed_one_leaves_no_twin(weights) -> None:
    w, _ = weights
    pack([w], min_elements=0)
    other = torch.randn(N, K)  # never packed: the op falls back
    x = torch.randn(16, K)
    assert torch.equal(torch.ops.batonlm.packed_linear(x, other, None), F.linear(x, other))
    gone = torch.randn(N, K)
    pack([gone], min_elements=0)
    key = lin._key(gone)
    del gone
    gc.collect()
    assert key not in lin._packed  # a later tensor at that address is not multiplied by it


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="no bfloat16 instructions")
def test_packed_bfloat16_weights_eager_and_compiled() -> None:
    """bfloat16 through oneDNN (float32 accumulation, the result rounded to bfloat16: within
    the float32 sum's bound plus 2^-8 of the result), compiled too, at one row as well (no
    reduction form in bfloat16)."""
    torch.manual_seed(0)
    w = torch.randn(N, K).to(torch.bfloat16)
    try:
        assert pack([w], min_elements=0) == w.numel() * 2
        step = torch.compile(lambda x: linear(x, w, None), dynamic=False, fullgraph=True)
        for rows in (1, 16):
            x = torch.randn(rows, K).to(torch.bfloat16)
            exact = x.double() @ w.double().T
            bound = K * 2.0**-24 * (x.double().abs() @ w.double().abs().T) + 2.0**-8 * exact.abs() + 1e-30
            for y in (linear(x, w), step(x)):
                assert y.dtype == torch.bfloat16 and ((y.double() - exact).abs() <= bound).all()
    finally:
        lin.unpack([w])


def test_pack_refuses_what_it_cannot_hold(monkeypatch) -> None:
    half = torch.randn(N, K, dtype=torch.float16)
    assert pack([half], min_elements=0) == 0  # float32 and bfloat16 only
    small = torch.randn(N, K)
    assert pack([small]) == 0  # below PACK_MIN_ELEMENTS: the BLAS is faster
    monkeypatch.setattr(lin, "PACK_MAX_BYTES", 1000)
    big = torch.randn(N, K)
    assert pack([big], min_elements=0) == 0 and lin._key(big) not in lin._packed


def test_linear_module_keeps_nn_linear_parameters() -> None:
    m = Linear(K, N)
    assert isinstance(m, torch.nn.Linear) and set(dict(m.named_parameters())) == {"weight", "bias"}
    x = torch.randn(2, K)
    torch.testing.assert_close(m(x), F.linear(x, m.weight, m.bias), rtol=0, atol=0)
