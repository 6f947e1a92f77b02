"""LLM.int8 (batonlm/kernels/llm_int8.py): the activation quantization with outlier columns, and
the GEMM of its int8 codes and outlier columns against int8 weights, the torch reference and the
Triton kernel (interpreted here; compiled in the `gpu` test), against float64.

Bounds (u = 2^-24): a code is x16 * fl(fl(1 / rs) * 127) rounded, the multiplier within 2u of
127 / rs, so a code is within 0.5 + 127 * 3u of the exact x16 * 127 / rs (at most one step from
it, and only next to a tie). The integer product is exact; times fl(rs * scb) and C1 it rounds
three times (3u relative). The outlier columns' float32 sum of K products errs by at most
K u sum |x| |w_q|, times scb and C2 (2u more); the output rounds once more (eps of its dtype).
bfloat16 activations multiply exactly (codes below 2^8).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_helpers import IMPLS, bad_argument_test, compiled_only  # noqa: E402

from batonlm.kernels.llm_int8 import (  # noqa: E402
    INT_SCALE,
    OUTLIER_SCALE,
    llm_int8_matmul,
    llm_int8_quant,
)

U = 2.0**-24


def _activations(m: int, k: int, seed: int, outliers: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Mostly |x| < 4, with `outliers` elements of 6..30 in a few columns (as LLM.int8's
    systematic outlier features)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    for i in range(outliers):
        x[torch.randint(0, m, (1,), generator=g), (7 * i + 3) % k] = (6 + 24 * torch.rand(1, generator=g)) * (
            1 if i % 2 else -1)
    return x.clamp(-30, 30).to(dtype)


@pytest.mark.parametrize("m,k,outliers,threshold", [(1, 64, 0, 6.0), (1, 96, 2, 6.0), (7, 200, 5, 6.0),
                                                    (7, 200, 5, 0.0), (33, 130, 9, 6.0)])
def test_quantization_is_the_rows_codes_with_outlier_columns_zeroed(m, k, outliers, threshold):
    x = _activations(m, k, seed=m + k, outliers=outliers)
    x_q, rs, cols = llm_int8_quant(x, threshold)
    x16 = x.half().double()
    outlier = (x16.abs() >= threshold) if threshold > 0 else torch.zeros_like(x16, dtype=torch.bool)
    assert torch.equal(cols.bool(), outlier.any(dim=0))
    assert bool(cols.any()) == (outliers > 0 and threshold > 0)
    kept = x16.masked_fill(outlier, 0)
    assert torch.equal(rs.double(), kept.abs().amax(dim=1))
    exact = kept * 127 / rs.double()[:, None]
    codes = x_q.double()
    inner = ~cols.bool()[None, :].expand(m, k)
    assert bool(((codes - exact).abs()[inner] <= 0.5 + 127 * 3 * U).all())
    assert not codes[:, cols.bool()].any()
    assert codes.abs().max() <= 127


def test_an_all_zero_row_quantizes_to_zeros():
    x = torch.zeros(3, 32)
    x[1, 4] = 10.0  # an outlier: row 1's other elements are 0 too
    x[2, 5] = 1.5
    x_q, rs, cols = llm_int8_quant(x, 6.0)
    assert rs.tolist() == [0.0, 0.0, 1.5] and not x_q[:2].any() and x_q[2, 5] == 127 and cols[4] == 1


def test_a_compiled_graph_keeps_the_float16_rounding():
    """5.999 is 6.0 in float16: an outlier at the threshold 6. Inductor keeps half-precision
    intermediates in float32 and would drop the round trip (the value no outlier, the row's
    statistic and codes other); the opaque `batonlm::float16_values` keeps it in a compiled step."""
    x = torch.full((2, 32), 0.3)
    x[0, 3] = 5.999
    x[1, 7] = 2 + 2.0**-9 + 2.0**-11  # float16's step there is 2^-9: it rounds to 2 + 2^-9
    eager = llm_int8_quant(x, 6.0)
    assert eager[2][3] == 1 and eager[1][1] == 2 + 2.0**-9
    compiled = torch.compile(llm_int8_quant, backend="inductor", fullgraph=True)(x, 6.0)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))


def _weights(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8), torch.rand(n, generator=g) * 0.5 + 0.01


def _truth(x, x_q, rs, cols, w_q, scb, bias):
    """float64: the formula; and the magnitude the float32 bound scales."""
    q = w_q.double()
    s = scb.double()[None, :]
    int_part = (x_q.double() @ q.T) * rs.double()[:, None] * s * INT_SCALE
    out = ((x.double() * cols.double()) @ q.T) * s * OUTLIER_SCALE
    y = int_part + out + (bias.double() if bias is not None else 0.0)
    k = x.shape[1]
    mag = int_part.abs() * 4 * U + ((x.double().abs() * cols.double()) @ q.abs().T) * s * OUTLIER_SCALE * (k + 3) * U
    return y, mag


def _traced(*args):
    """The reference as a compiled graph runs it (the outlier columns' product one opaque op)."""
    return torch.compile(lambda *a: llm_int8_matmul(*a, use_triton=False), backend="eager", fullgraph=True)(*args)


@pytest.mark.parametrize("use_triton", [*IMPLS, pytest.param("traced", id="traced")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,outliers", [(1, 48, 64, 2), (7, 40, 200, 5), (33, 130, 96, 0), (17, 64, 130, 9)])
def test_matmul_equals_float64(use_triton, dtype, m, n, k, outliers):
    """The reference (the outlier columns gathered), traced, and the Triton kernel (masked)."""
    x = _activations(m, k, seed=m * n, outliers=outliers, dtype=dtype)
    w_q, scb = _weights(n, k, seed=k)
    bias = torch.randn(n).to(dtype) if m == 7 else None
    x_q, rs, cols = llm_int8_quant(x, 6.0)
    if use_triton == "traced":
        got = _traced(x, x_q, rs, cols, w_q, scb, bias)
    else:
        got = llm_int8_matmul(x, x_q, rs, cols, w_q, scb, bias, use_triton=use_triton)
    assert got.dtype == dtype and got.shape == (m, n)
    want, mag = _truth(x, x_q, rs, cols, w_q, scb, bias)
    bound = mag + torch.finfo(dtype).eps * want.abs() + 1e-30
    err = (got.double() - want).abs()
    assert bool((err <= bound).all()), f"max err/bound {float((err / bound).max()):.3g}"


@pytest.mark.parametrize("use_triton", IMPLS)
def test_the_outlier_columns_are_multiplied_in_float(use_triton):
    """An outlier of 20 in one column: its product is x * W (not its 8-bit code's, and not left
    out); with the threshold 0 it is quantized with its row (the row's scale 20 / 127)."""
    x = torch.full((2, 64), 0.25)
    x[0, 10] = 20.0
    w_q, scb = _weights(8, 64, seed=1)
    w = w_q.double() * scb.double()[:, None] / 127
    x_q, rs, cols = llm_int8_quant(x, 6.0)
    got = llm_int8_matmul(x, x_q, rs, cols, w_q, scb, use_triton=use_triton).double()
    assert (got - x.double() @ w.T).abs().max() < 1e-3 * (x.double().abs() @ w.abs().T).max()
    no_outliers = llm_int8_matmul(x, *llm_int8_quant(x, 0.0), w_q, scb, use_triton=use_triton).double()
    assert (no_outliers[0] - (x.double() @ w.T)[0]).abs().max() > 1e-2  # 0.25 coded by a step of 20 / 127


def _bad_calls():
    x, w_q, scb = torch.zeros(3, 64), torch.zeros(8, 64, dtype=torch.int8), torch.ones(8)
    x_q, rs, cols = llm_int8_quant(x, 6.0)
    return {
        "threshold": lambda t: llm_int8_quant(x, -1.0),
        "x": lambda t: llm_int8_quant(x[0], 6.0),
        "x_q": lambda t: llm_int8_matmul(x, x_q[:2], rs, cols, w_q, scb, use_triton=t),
        "w_q": lambda t: llm_int8_matmul(x, x_q, rs, cols, w_q.float(), scb, use_triton=t),
        "rs": lambda t: llm_int8_matmul(x, x_q, rs[:2], cols, w_q, scb, use_triton=t),
        "cols": lambda t: llm_int8_matmul(x, x_q, rs, cols.bool(), w_q, scb, use_triton=t),
        "scb": lambda t: llm_int8_matmul(x, x_q, rs, cols, w_q, scb.half(), use_triton=t),
        "bias": lambda t: llm_int8_matmul(x, x_q, rs, cols, w_q, scb, torch.zeros(5), use_triton=t),
    }


test_a_bad_argument_is_named = bad_argument_test(_bad_calls)


@pytest.mark.gpu
@compiled_only
@pytest.mark.parametrize("m", [1, 64])
def test_gpu_llm_int8(m):
    """A Llama-8B-sized projection in bfloat16 with outlier columns."""
    n = k = 4096
    x = _activations(m, k, seed=m, outliers=12, dtype=torch.bfloat16)
    w_q, scb = _weights(n, k, seed=2)
    x_q, rs, cols = llm_int8_quant(x.cuda(), 6.0)
    got = llm_int8_matmul(x.cuda(), x_q, rs, cols, w_q.cuda(), scb.cuda()).cpu()
    want, mag = _truth(x, x_q.cpu(), rs.cpu(), cols.cpu(), w_q, scb, None)
    assert torch.equal(x_q.cpu(), llm_int8_quant(x, 6.0)[0])
    assert bool(((got.double() - want).abs() <= mag + 2.0**-8 * want.abs() + 1e-30).all())
