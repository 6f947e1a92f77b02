"""The W8A8-int8 kernels (batonlm/kernels/int8.py): the torch references and the Triton kernels
(interpreted on the CPU; compiled in the `gpu` test at the end) against float64 and against
each other.

Bounds, from the math (u = 2^-24):
- The scale amax / 127.5 is one correctly rounded float32 quotient: within u of the exact one.
- A code is x / scale (one more rounding, u relative) rounded half to even: within 1/2 + u |x /
  scale| of the exact quotient, saturated at -128 and 127.
- The int32 product is exact; converting it to float32 and multiplying by two scales rounds
  three times: within 3u (1 + u)^2 < 4u of the exact y, plus the bias's addition (u |y + b|) and
  the output dtype's rounding.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_helpers import IMPLS, bad_argument_test, compiled_only, interpreted_only  # noqa: E402

from batonlm.kernels import int8 as I8  # noqa: E402

U = 2.0**-24


def _activations(g: torch.Generator, m: int, k: int) -> torch.Tensor:
    """Rows of very different magnitudes, an outlier, and (with 3+ rows) an all-zero row."""
    x = torch.randn(m, k, generator=g) * 2.0 ** torch.randint(-6, 7, (m, 1), generator=g)
    x[0, min(5, k - 1)] = -300.0
    if m > 2:
        x[2] = 0.0
    return x


@pytest.mark.parametrize("use_triton", IMPLS)
@pytest.mark.parametrize("m,k,dtype", [(1, 7, torch.float32), (3, 200, torch.float32), (17, 320, torch.bfloat16),
                                       (2, 9000, torch.float32)])
def test_per_token_codes_are_the_rounded_quotients(use_triton, m, k, dtype):
    x = _activations(torch.Generator().manual_seed(m * k), m, k).to(dtype)
    q, scale = I8.per_token_quant_int8(x, use_triton=use_triton)
    assert q.dtype == torch.int8 and q.shape == (m, k) and scale.dtype == torch.float32 and scale.shape == (m, 1)
    x64 = x.double()
    amax = x64.abs().amax(dim=1, keepdim=True)
    exact = amax / 127.5
    nonzero = amax[:, 0] > 0
    assert ((scale.double() - exact).abs() <= U * exact)[nonzero].all()
    assert (scale > 0).all() and (q[~nonzero] == 0).all()  # an all-zero token: zeros, no 0 / 0
    quotient = x64 / scale.double()
    err = (q.double() - quotient.clamp(-128, 127)).abs()
    assert (err <= 0.5 + 2 * U * quotient.abs()).all()
    # The token's largest |x| is +-127.5 codes before rounding: it lands on 127 or -128 (+-127 when
    # the rounded scale puts it just inside), the range's end.
    top = x64.abs().argmax(dim=1)
    assert (q.gather(1, top[:, None])[nonzero, 0].int().abs() >= 127).all()


@pytest.mark.parametrize("use_triton", IMPLS)
def test_ties_round_to_even_and_the_range_saturates(use_triton):
    x = torch.tensor([[0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 127.5, 128.0, 1e9, -128.5, -1e9, 3.49]])
    q = I8.static_quant_int8(x, torch.tensor([1.0]), use_triton=use_triton)
    assert q.tolist() == [[0, 2, 2, 0, -2, -2, 126, 127, 127, 127, -128, -128, 3]]
    # Per token, the largest |x| is 127.5 codes (here exactly: a scale of 1): +amax -> 128 (even)
    # -> 127; -amax -> -128.
    pos, s = I8.per_token_quant_int8(torch.tensor([[127.5, -64.0, 0.0]]), use_triton=use_triton)
    neg, _ = I8.per_token_quant_int8(torch.tensor([[-127.5, 64.0, 0.5]]), use_triton=use_triton)
    assert s.item() == 1.0 and pos.tolist() == [[127, -64, 0]] and neg.tolist() == [[-128, 64, 0]]


@interpreted_only
@pytest.mark.parametrize("m,k", [(17, 320), (3, 9000), (1, 1)])
def test_triton_quantization_is_the_reference_bit_for_bit(m, k):
    x = _activations(torch.Generator().manual_seed(k), m, k)
    q, s = I8.per_token_quant_int8(x, use_triton=True)
    q_ref, s_ref = I8.per_token_quant_int8_reference(x)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    static = torch.tensor([0.37])
    assert torch.equal(I8.static_quant_int8(x, static, use_triton=True), I8.static_quant_int8_reference(x, static))


@pytest.mark.parametrize("use_triton", IMPLS)
def test_static_quantization_takes_a_scale_per_row(use_triton):
    """[M, 1] scales (each MoE pair row by its expert's static scale): row i is the per-tensor
    quantization of row i by scale i."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(9, 130, generator=g) * 30
    scales = 2.0 ** (torch.rand(9, 1, generator=g) * 6 - 3)
    q = I8.static_quant_int8(x, scales, use_triton=use_triton)
    for i in range(9):
        assert torch.equal(q[i : i + 1], I8.static_quant_int8_reference(x[i : i + 1], scales[i, 0]))


def _matmul_case(g: torch.Generator, m: int, n: int, k: int, per_token: bool, per_channel: bool, bias: bool):
    x_q = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8)
    w_q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    x_scale = torch.rand(m, 1, generator=g) * 1e-2 + 1e-4 if per_token else torch.tensor([3e-3])
    w_scale = torch.rand(n, generator=g) * 1e-2 + 1e-4 if per_channel else torch.tensor(2e-3)
    b = torch.randn(n, generator=g) if bias else None
    return x_q, x_scale, w_q, w_scale, b


@pytest.mark.parametrize("use_triton", IMPLS)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,per_token,per_channel,bias", [
    (1, 48, 200, True, True, False), (3, 200, 320, True, True, True), (17, 5, 64, False, True, True),
    (2, 33, 129, True, False, False), (5, 16, 1, False, False, True),
])
def test_int8_scaled_matmul_equals_float64(use_triton, out_dtype, m, n, k, per_token, per_channel, bias):
    x_q, x_scale, w_q, w_scale, b = _matmul_case(torch.Generator().manual_seed(n + k), m, n, k, per_token,
                                                 per_channel, bias)
    got = I8.int8_scaled_matmul(x_q, x_scale, w_q, w_scale, out_dtype, b, use_triton=use_triton)
    assert got.dtype == out_dtype and got.shape == (m, n)
    s = x_scale.double().reshape(-1, 1) * w_scale.double().reshape(1, -1)
    prod = (x_q.double() @ w_q.double().T) * s
    want = prod + (b.double() if b is not None else 0.0)
    out_u = torch.finfo(out_dtype).eps / 2
    bound = 4 * U * prod.abs() + U * want.abs() + out_u * want.abs() * (1 + 8 * U)
    assert ((got.double() - want).abs() <= bound).all()


@interpreted_only
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(17, 200, 320), (1, 48, 200), (3, 5, 129)])
def test_triton_matmul_is_the_reference_bit_for_bit(m, n, k, out_dtype):
    x_q, x_scale, w_q, w_scale, b = _matmul_case(torch.Generator().manual_seed(m), m, n, k, True, True, True)
    got = I8.int8_scaled_matmul(x_q, x_scale, w_q, w_scale, out_dtype, b, use_triton=True)
    assert torch.equal(got, I8.int8_scaled_matmul_reference(x_q, x_scale, w_q, w_scale, out_dtype, b))


def test_the_cpu_int8_product_is_exact():
    """The CPU reference sums in oneDNN's int8 GEMM: the int64 truth at the extremes."""
    x_q = torch.full((4, 384), -128, dtype=torch.int8)
    w_q = torch.full((8, 384), -128, dtype=torch.int8)
    w_q[1] = 127
    got = I8.int_product(x_q, w_q)
    assert torch.equal(got.long(), x_q.long() @ w_q.long().T) and got[0, 0] == 128 * 128 * 384


def _bad_calls():
    x_q = torch.zeros(2, 8, dtype=torch.int8)
    w_q = torch.zeros(4, 8, dtype=torch.int8)
    xs, ws = torch.ones(2, 1), torch.ones(4)
    mm = I8.int8_scaled_matmul
    return {
        "x": lambda t: I8.per_token_quant_int8(torch.zeros(2, 8, dtype=torch.int32), use_triton=t),
        "scale": lambda t: I8.static_quant_int8(torch.zeros(2, 8), torch.ones(2), use_triton=t),
        "x_q": lambda t: mm(x_q.float(), xs, w_q, ws, torch.float32, use_triton=t),
        "w_q": lambda t: mm(x_q, xs, torch.zeros(4, 9, dtype=torch.int8), ws, torch.float32, use_triton=t),
        "x_scale": lambda t: mm(x_q, torch.ones(3, 1), w_q, ws, torch.float32, use_triton=t),
        "w_scale": lambda t: mm(x_q, xs, w_q, torch.ones(4, dtype=torch.float64), torch.float32, use_triton=t),
        "bias": lambda t: mm(x_q, xs, w_q, ws, torch.float32, torch.ones(5), use_triton=t),
    }


test_a_bad_argument_is_named = bad_argument_test(_bad_calls)


# --- compiled, at a real layer's size (int8 tensor-core MMAs accumulate exactly in int32) -----------


@pytest.mark.gpu
@compiled_only
@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (64, 4096, 4096), (17, 1000, 1000)])
def test_gpu_int8_kernels(m, n, k):
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16) * 3
    q, s = I8.per_token_quant_int8(x)
    q_ref, s_ref = I8.per_token_quant_int8_reference(x)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    w_q = torch.randint(-128, 128, (n, k), device="cuda", generator=g, dtype=torch.int8)
    w_scale = torch.rand(n, device="cuda", generator=g) * 1e-2
    bias = torch.randn(n, device="cuda", generator=g, dtype=torch.bfloat16)
    got = I8.int8_scaled_matmul(q, s, w_q, w_scale, torch.bfloat16, bias)
    assert torch.equal(got, I8.int8_scaled_matmul_reference(q, s, w_q, w_scale, torch.bfloat16, bias))


def test_one_row_of_a_compiled_graphs_buffer_multiplies_exactly():
    """In a compiled graph (inductor) a row sliced from a larger int8 buffer reaches the int8 GEMM
    with a zero row stride, which torch 2.13's CPU `_int_mm` misreads (garbage sums): the gathered
    int8 experts of the compiled batch-1 graph did so. `int_product` gives it a real row."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, 64, generator=g) * 40
    w_q = torch.randint(-128, 128, (96, 64), generator=g, dtype=torch.int8)

    def rows(x: torch.Tensor) -> torch.Tensor:
        q = torch.round(x).clamp(-128, 127).to(torch.int8)
        return torch.stack([I8.int_product(q[i : i + 1], w_q) for i in range(3)])

    torch._dynamo.reset()
    want = torch.round(x).clamp(-128, 127).double() @ w_q.double().T
    assert torch.equal(torch.compile(rows, backend="inductor", fullgraph=True)(x).squeeze(1).double(), want)
