"""The int8 kernels with zero points (batonlm/kernels/int8.py: asymmetric activations, per token
or per tensor, and the matmul that takes the zero point off in int32), torch and Triton
(interpreted on the CPU; compiled in the `gpu` test at the end), against float64 and each other.

Bounds, from the math (u = 2^-24):
- scale = (hi - lo) / 255: the difference rounds once, the quotient once: within 2u (1 + u) of
  the exact quotient of the exact range (hi and lo are values of x: exact).
- zero = -128 - lo / scale rounded half to even: the quotient and the subtraction round once
  each, so the float32 value is within u |lo / scale| + u |-128 - lo / scale| <= 2u * 256 of the
  exact -128 - lo / scale (at most 255 in size), and the integer within 1/2 + 2^-15 of it.
- a code is x / scale + zero, two roundings again, then rounded half to even: within 1/2 + u
  |x / scale| + u |x / scale + zero| of the exact value, saturated at -128 and 127.
- the matmul: the int32 sum exact; the rest as the symmetric one's (4u of the product).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_helpers import IMPLS, bad_argument_test, compiled_only, interpreted_only  # noqa: E402

from batonlm.kernels import int8 as I8  # noqa: E402

U = 2.0**-24


def _activations(g: torch.Generator, m: int, k: int) -> torch.Tensor:
    """Rows of very different magnitudes and offsets: an outlier, an all-zero row, an all-positive
    row (its range widened to 0: zero point -128) and an all-negative one (127)."""
    x = torch.randn(m, k, generator=g) * 2.0 ** torch.randint(-6, 7, (m, 1), generator=g)
    x = x + torch.randn(m, 1, generator=g) * x.abs().amax(1, keepdim=True)
    x[0, min(5, k - 1)] = -300.0
    if m > 3:
        x[1] = x[1].abs() + 0.5
        x[2] = 0.0
        x[3] = -x[3].abs() - 0.25
    return x


@pytest.mark.parametrize("use_triton", IMPLS)
@pytest.mark.parametrize("m,k,dtype", [(1, 7, torch.float32), (5, 200, torch.float32), (17, 320, torch.bfloat16),
                                       (4, 9000, torch.float32)])
def test_per_token_asymmetric_codes_are_the_rounded_quotients(use_triton, m, k, dtype):
    x = _activations(torch.Generator().manual_seed(m * k), m, k).to(dtype)
    q, scale, zero = I8.per_token_quant_int8_asym(x, use_triton=use_triton)
    assert (q.dtype, q.shape, scale.dtype, scale.shape, zero.dtype, zero.shape) == (
        torch.int8, (m, k), torch.float32, (m, 1), torch.int32, (m, 1))
    x64 = x.double()
    lo, hi = x64.amin(1, keepdim=True).clamp(max=0), x64.amax(1, keepdim=True).clamp(min=0)
    exact = (hi - lo) / 255
    nonzero = exact[:, 0] > 0
    assert ((scale.double() - exact).abs() <= 2 * U * (1 + U) * exact)[nonzero].all()
    assert (scale[~nonzero] == I8.ASYM_ZERO_SCALE).all()
    s64 = scale.double()
    z_exact = -128 - lo / s64
    assert ((zero.double() - z_exact.clamp(-128, 127)).abs() <= 0.5 + 2**-15).all()
    quotient = x64 / s64 + zero.double()
    err = (q.double() - quotient.clamp(-128, 127)).abs()
    assert (err <= 0.5 + 2 * U * (x64.abs() / s64 + quotient.abs())).all()
    # The range's ends land on the code range's: lo on -128 (or -127 by the rounding of the scale
    # and zero), hi on 127 (126); 0 is the zero point itself, exactly, so it dequantizes to 0.
    assert (q.gather(1, x64.argmin(1, keepdim=True)).int() <= -127)[nonzero & (lo[:, 0] < 0)].all()
    assert (q.gather(1, x64.argmax(1, keepdim=True)).int() >= 126)[nonzero & (hi[:, 0] > 0)].all()
    assert (q.int() == zero.expand(m, k))[x == 0].all()
    assert (q[~nonzero].int() == zero[~nonzero]).all()  # an all-zero token: every code its zero point
    if m > 3:  # an all-positive token starts its range at 0 (zero point -128), an all-negative one ends it there
        assert zero[1].item() == -128 and zero[3].item() == 127


@pytest.mark.parametrize("use_triton", IMPLS)
def test_static_zero_points_shift_the_codes_and_the_range_saturates(use_triton):
    x = torch.tensor([[0.5, 1.5, -0.5, -2.5, 124.5, 125.0, 1e9, -130.5, -131.5, -1e9, 0.0]])
    q = I8.static_quant_int8(x, torch.tensor([1.0]), torch.tensor([3], dtype=torch.int32), use_triton=use_triton)
    # x + 3, rounded half to even, saturated: 3.5 -> 4, 4.5 -> 4, 2.5 -> 2, 0.5 -> 0, 127.5 -> 128 -> 127, ...
    assert q.tolist() == [[4, 4, 2, 0, 127, 127, 127, -128, -128, -128, 3]]
    # Per row: row i by its own scale and zero.
    g = torch.Generator().manual_seed(4)
    x = torch.randn(9, 130, generator=g) * 30
    scales = 2.0 ** (torch.rand(9, 1, generator=g) * 6 - 3)
    zeros = torch.randint(-128, 128, (9, 1), generator=g, dtype=torch.int32)
    q = I8.static_quant_int8(x, scales, zeros, use_triton=use_triton)
    for i in range(9):
        want = torch.round(x[i].double() / scales[i, 0].double() + zeros[i, 0].item()).clamp(-128, 127)
        assert (q[i].double() - want).abs().max() <= 1
        assert torch.equal(q[i : i + 1], I8.static_quant_int8_reference(x[i : i + 1], scales[i, 0], zeros[i, 0]))


@interpreted_only
@pytest.mark.parametrize("m,k", [(17, 320), (4, 9000), (1, 1), (6, 33)])
def test_triton_asymmetric_quantization_is_the_reference_bit_for_bit(m, k):
    x = _activations(torch.Generator().manual_seed(k), m, k)
    got = I8.per_token_quant_int8_asym(x, use_triton=True)
    want = I8.per_token_quant_int8_asym_reference(x)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    scale, zero = torch.tensor([0.37]), torch.tensor([-17], dtype=torch.int32)
    assert torch.equal(I8.static_quant_int8(x, scale, zero, use_triton=True),
                       I8.static_quant_int8_reference(x, scale, zero))


def _matmul_case(g: torch.Generator, m: int, n: int, k: int, per_token: bool, bias: bool):
    x_q = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8)
    w_q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    x_scale = torch.rand(m, 1, generator=g) * 1e-2 + 1e-4 if per_token else torch.tensor([3e-3])
    x_zero = torch.randint(-128, 128, tuple(x_scale.shape), generator=g, dtype=torch.int32)
    w_scale = torch.rand(n, generator=g) * 1e-2 + 1e-4
    b = torch.randn(n, generator=g) if bias else None
    return x_q, x_scale, x_zero, w_q, w_scale, b


@pytest.mark.parametrize("use_triton", IMPLS)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,per_token,bias", [
    (1, 48, 200, True, False), (3, 200, 320, True, True), (17, 5, 64, False, True), (5, 16, 1, True, False),
])
def test_matmul_with_zero_points_equals_float64(use_triton, out_dtype, m, n, k, per_token, bias):
    x_q, x_scale, x_zero, w_q, w_scale, b = _matmul_case(torch.Generator().manual_seed(n + k), m, n, k, per_token,
                                                         bias)
    got = I8.int8_scaled_matmul(x_q, x_scale, w_q, w_scale, out_dtype, b, x_zero=x_zero, w_sum=I8.weight_sums(w_q),
                                use_triton=use_triton)
    assert got.dtype == out_dtype and got.shape == (m, n)
    s = x_scale.double().reshape(-1, 1) * w_scale.double().reshape(1, -1)
    prod = ((x_q.double() - x_zero.double().reshape(-1, 1)) @ w_q.double().T) * s
    want = prod + (b.double() if b is not None else 0.0)
    out_u = torch.finfo(out_dtype).eps / 2
    bound = 4 * U * prod.abs() + U * want.abs() + out_u * want.abs() * (1 + 8 * U)
    assert ((got.double() - want).abs() <= bound).all()


@pytest.mark.parametrize("use_triton", IMPLS)
def test_the_zero_point_product_is_exact_at_the_extremes(use_triton):
    """(x - zero) spans 255 codes: -128 - 127 everywhere, against weights of -128 and 127, is
    -255 * -128 * K, exact in int32 (here within 2^24 too, so float32 holds it exactly)."""
    k = 384
    x_q = torch.full((2, k), -128, dtype=torch.int8)
    w_q = torch.full((3, k), -128, dtype=torch.int8)
    w_q[1] = 127
    w_q[2, ::2] = 127
    zero = torch.tensor([[127], [-128]], dtype=torch.int32)
    one = torch.ones(2, 1)
    got = I8.int8_scaled_matmul(x_q, one, w_q, torch.ones(3), torch.float32, x_zero=zero, w_sum=I8.weight_sums(w_q),
                                use_triton=use_triton)
    want = (x_q.long() - zero.long()) @ w_q.long().T
    assert torch.equal(got.double(), want.double()) and got[0, 0] == 255 * 128 * k


@interpreted_only
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,per_token", [(17, 200, 320, True), (1, 48, 200, True), (3, 5, 129, False)])
def test_triton_matmul_with_zero_points_is_the_reference_bit_for_bit(m, n, k, per_token, out_dtype):
    x_q, x_scale, x_zero, w_q, w_scale, b = _matmul_case(torch.Generator().manual_seed(m), m, n, k, per_token, True)
    w_sum = I8.weight_sums(w_q)
    got = I8.int8_scaled_matmul(x_q, x_scale, w_q, w_scale, out_dtype, b, x_zero=x_zero, w_sum=w_sum, use_triton=True)
    assert torch.equal(got, I8.int8_scaled_matmul_reference(x_q, x_scale, w_q, w_scale, out_dtype, b, x_zero, w_sum))


def _bad_calls():
    x_q = torch.zeros(2, 8, dtype=torch.int8)
    w_q = torch.zeros(4, 8, dtype=torch.int8)
    xs, ws, xz, wsum = torch.ones(2, 1), torch.ones(4), torch.zeros(2, 1, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)
    mm = I8.int8_scaled_matmul
    return {
        "x": lambda t: I8.per_token_quant_int8_asym(torch.zeros(2, 8, dtype=torch.int32), use_triton=t),
        "zero": lambda t: I8.static_quant_int8(torch.zeros(2, 8), torch.ones(1), torch.zeros(2, 1, dtype=torch.int32),
                                               use_triton=t),
        "w_sum": lambda t: mm(x_q, xs, w_q, ws, torch.float32, x_zero=xz, use_triton=t),
        "x_zero": lambda t: mm(x_q, xs, w_q, ws, torch.float32, x_zero=xz.float(), w_sum=wsum, use_triton=t),
    }


test_a_bad_argument_is_named = bad_argument_test(_bad_calls)


@pytest.mark.gpu
@compiled_only
@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (64, 4096, 4096), (17, 1000, 1000)])
def test_gpu_asymmetric_int8_kernels(m, n, k):
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16) * 3 + 1
    got, want = I8.per_token_quant_int8_asym(x), I8.per_token_quant_int8_asym_reference(x)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    q, s, z = got
    w_q = torch.randint(-128, 128, (n, k), device="cuda", generator=g, dtype=torch.int8)
    w_scale = torch.rand(n, device="cuda", generator=g) * 1e-2
    w_sum = I8.weight_sums(w_q)
    y = I8.int8_scaled_matmul(q, s, w_q, w_scale, torch.bfloat16, x_zero=z, w_sum=w_sum)
    assert torch.equal(y, I8.int8_scaled_matmul_reference(q, s, w_q, w_scale, torch.bfloat16, None, z, w_sum))
