"""The quantized-GEMM kernels (batonlm/kernels/quant.py): the torch references and the Triton
kernels (interpreted on the CPU; compiled in the `gpu` tests at the end) against float64.

Bounds, from the math rather than from one machine's results (u = 2^-24, eps = 2u):
- Quantizing to a float format of p mantissa bits (finfo.eps = 2^-p) rounds to nearest, so
  |v - fl(v)| <= eps/2 * |v| for a normal v and <= eps/2 * tiny (half the subnormal spacing)
  below tiny; v = x / scale is itself a correctly rounded float32 quotient (u |x| in x's units).
  e4m3: relative 2^-4, absolute 2^-10 * scale; e5m2: 2^-3 and 2^-17 * scale.
- A float32 sum of n terms (products exact or rounded once) errs by at most n u sum|terms|;
  with the scale multiplications and the K blocks' sums, at most (K + 4) eps sum|x||w|, plus
  the output's rounding (eps of the output dtype times |y|). int4 with bfloat16 activations
  multiplies W rounded to bfloat16: 2^-8 sum|x||w| more.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_helpers import IMPLS, bad_argument_test, compiled_only, interpreted_only  # noqa: E402

from batonlm.kernels import int4 as I4  # noqa: E402
from batonlm.kernels import quant as Q  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
EPS32 = torch.finfo(torch.float32).eps


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _activations(g: torch.Generator, m: int, k: int) -> torch.Tensor:
    """Rows of very different magnitudes, an outlier, and an all-zero span of columns."""
    x = torch.randn(m, k, generator=g) * 2.0 ** torch.randint(-6, 7, (m, 1), generator=g)
    x[0, min(5, k - 1)] = 300.0
    if m > 2 and k > 130:
        x[2, 64:128] = 0.0
    return x


def _fp8_values(g: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype = E4M3) -> torch.Tensor:
    """FP8 values over the format's whole range: subnormals, normals, +-max."""
    mag = 2.0 ** (torch.rand(shape, generator=g) * 20 - 11)
    fmax = torch.finfo(dtype).max
    return (torch.randn(shape, generator=g) * mag).clamp(-fmax, fmax).to(dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# --- FP8 activation quantization -------------------------------------------------------------


def _round_trip_bound(x: torch.Tensor, scale_per_elem: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    fi = torch.finfo(dtype)
    x64, s64 = x.double().abs(), scale_per_elem.double()
    return fi.eps / 2 * x64 + fi.eps / 2 * fi.tiny * s64 + 2.0**-24 * x64 * (1 + fi.eps)


@pytest.mark.parametrize("use_triton", IMPLS)
@pytest.mark.parametrize("m,k,group,dtype", [(1, 128, 128, E4M3), (3, 200, 128, E4M3), (17, 320, 64, E4M3),
                                             (5, 200, 128, E5M2)])
def test_group_quantization_round_trips_within_the_format_rounding(use_triton, m, k, group, dtype):
    x = _activations(torch.Generator().manual_seed(m * k), m, k).bfloat16()
    q, scale = Q.per_token_group_quant_fp8(x, group, dtype, use_triton=use_triton)
    assert q.dtype == dtype and q.shape == (m, k) and scale.dtype == torch.float32
    assert scale.shape == (m, _cdiv(k, group))
    fmax = torch.finfo(dtype).max
    for gi in range(scale.shape[1]):  # each group (the last one partial) scaled by its own amax
        cols = slice(gi * group, (gi + 1) * group)
        amax = x[:, cols].double().abs().amax(dim=1)
        want = (amax / fmax).float().clamp(min=torch.finfo(torch.float32).tiny)  # correctly rounded
        assert torch.equal(scale[:, gi], want)
        qmax = q[:, cols].float().abs().amax(dim=1)
        assert torch.equal(qmax[amax > 0], torch.full_like(qmax[amax > 0], fmax))  # amax -> +-max
    per_elem = scale.repeat_interleave(group, 1)[:, :k]
    back = q.double() * per_elem.double()
    assert not back.isnan().any()
    assert ((back - x.double()).abs() <= _round_trip_bound(x, per_elem, dtype)).all()


@pytest.mark.parametrize("use_triton", IMPLS)
def test_a_zero_group_quantizes_to_zeros(use_triton):
    x = torch.zeros(3, 256)
    x[1, :128] = torch.randn(128)
    q, scale = Q.per_token_group_quant_fp8(x, 128, use_triton=use_triton)
    assert (scale > 0).all() and torch.isfinite(scale).all()
    assert torch.equal(q[0].float(), torch.zeros(256)) and torch.equal(q[1, 128:].float(), torch.zeros(128))
    back = q.float() * scale.repeat_interleave(128, 1)
    assert not back.isnan().any() and torch.equal(back[x == 0], x[x == 0])


@pytest.mark.parametrize("use_triton", IMPLS)
def test_a_capped_amax_saturates_the_larger_values(use_triton):
    """FBGEMM FP8's activation bound (`amax_ub`): a row whose amax exceeds it is scaled by
    ub / max, its values beyond ub saturate to +-max, the rest round as usual; a row under it is
    quantized as without it. `min_scale` floors a near-zero row's scale (FBGEMM's 1 / (448 * 512))."""
    x = _activations(torch.Generator().manual_seed(5), 9, 200)
    ub, floor = 2.0, 1 / (448 * 512)
    x[4] *= 1e-6  # amax ~1e-5: its scale is the floor
    q, scale = Q.per_token_quant_fp8(x, amax_ub=ub, min_scale=floor, use_triton=use_triton)
    amax = x.double().abs().amax(dim=1)
    want = (amax.clamp(max=ub) / 448).float().clamp(min=floor)
    assert torch.equal(scale[:, 0], want)
    assert (amax > ub).sum() >= 3 and (amax < ub).sum() >= 3 and scale[4, 0] == torch.tensor(floor, dtype=torch.float32)
    back = q.double() * scale.double()
    over = x.double().abs() > ub
    assert over.any() and torch.equal(back[over], (448 * x.double().sign() * scale.double())[over])
    assert ((back - x.double()).abs()[~over] <= _round_trip_bound(x[~over], scale.expand(-1, 200)[~over], E4M3)).all()
    plain_q, plain_s = Q.per_token_quant_fp8(x, use_triton=use_triton)
    under = amax < ub
    under[4] = False
    assert torch.equal(scale[under], plain_s[under]) and _same_bits(q[under], plain_q[under])
    if use_triton:
        rq, rs = Q.per_token_quant_fp8(x, amax_ub=ub, min_scale=floor, use_triton=False)
        assert torch.equal(scale, rs) and _same_bits(q, rq)


@interpreted_only
@pytest.mark.parametrize("m,k,group", [(17, 320, 128), (3, 200, 64), (2, 9000, 9000)])
def test_triton_quantization_is_the_reference_bit_for_bit(m, k, group):
    """Same float32 divisions (correctly rounded in both), same rounding to FP8; the last case
    is one group longer than the kernel's chunk (read in several)."""
    x = _activations(torch.Generator().manual_seed(k), m, k)
    ref_q, ref_s = Q.per_token_group_quant_fp8_reference(x, group)
    q, s = Q.per_token_group_quant_fp8(x, group, use_triton=True)
    assert torch.equal(s, ref_s) and _same_bits(q, ref_q)
    tq, ts = Q.per_token_quant_fp8(x, use_triton=True)
    rq, rs = Q.per_token_quant_fp8(x, use_triton=False)
    assert ts.shape == (m, 1) and torch.equal(ts, rs) and _same_bits(tq, rq)


@pytest.mark.parametrize("use_triton", IMPLS)
def test_static_quantization_saturates_at_the_format_max(use_triton):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(17, 200, generator=g) * 300
    scale = torch.tensor(0.5)
    q = Q.static_quant_fp8(x.bfloat16(), scale, use_triton=use_triton)
    v = x.bfloat16().double() / 0.5
    over = v.abs() > 448
    assert over.sum() > 100 and not q.float().isnan().any()
    assert torch.equal(q.float()[over], 448.0 * v[over].sign().float())
    err = (q.double()[~over] * 0.5 - x.bfloat16().double()[~over]).abs()
    assert (err <= _round_trip_bound(x.bfloat16()[~over], torch.full_like(err, 0.5), E4M3)).all()
    if use_triton:
        assert _same_bits(q, Q.static_quant_fp8_reference(x.bfloat16(), scale))


@pytest.mark.parametrize("use_triton", IMPLS)
def test_static_quantization_takes_a_scale_per_row(use_triton):
    """[M, 1] scales (each MoE pair row by its expert's static scale): row i is the per-tensor
    quantization of row i by scale i, bit for bit."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(9, 130, generator=g) * 100
    scales = 2.0 ** (torch.rand(9, 1, generator=g) * 6 - 3)
    q = Q.static_quant_fp8(x, scales, use_triton=use_triton)
    for i in range(9):
        assert _same_bits(q[i : i + 1], Q.static_quant_fp8_reference(x[i : i + 1], scales[i, 0]))
    with pytest.raises(ValueError, match="^scale:"):
        Q.static_quant_fp8(x, scales[:-1], use_triton=use_triton)


# --- FP8 block-wise matmul ---------------------------------------------------------------------


def _block_case(m: int, n: int, k: int, block: tuple[int, int], seed: int):
    g = torch.Generator().manual_seed(seed)
    bn, bk = block
    x_q, x_scale = Q.per_token_group_quant_fp8(_activations(g, m, k), bk)
    w_q = _fp8_values(g, (n, k))
    w_scale = 2.0 ** (torch.rand(_cdiv(n, bn), _cdiv(k, bk), generator=g) * 12 - 14)
    return x_q, x_scale, w_q, w_scale


def _block_truth(x_q, x_scale, w_q, w_scale, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """y and sum|x||w| in float64, block by block of the checkpoint's meaning."""
    xq, wq = x_q.double(), w_q.double()
    y = torch.zeros(x_q.shape[0], w_q.shape[0], dtype=torch.float64, device=x_q.device)
    mag = torch.zeros_like(y)
    for kb in range(x_scale.shape[1]):
        ks = slice(kb * bk, (kb + 1) * bk)
        for nb in range(w_scale.shape[0]):
            ns = slice(nb * bn, (nb + 1) * bn)
            s = x_scale[:, kb].double()[:, None] * w_scale[nb, kb].double()
            y[:, ns] += (xq[:, ks] @ wq[ns, ks].T) * s
            mag[:, ns] += (xq[:, ks].abs() @ wq[ns, ks].abs().T) * s
    return y, mag


def _assert_within(got: torch.Tensor, want: torch.Tensor, mag: torch.Tensor, rel: float) -> None:
    bound = rel * mag + torch.finfo(got.dtype).eps * want.abs() + 1e-30
    err = (got.double() - want).abs()
    assert bool((err <= bound).all()), f"max err/bound {float((err / bound).max()):.3g}"


@pytest.mark.parametrize("use_triton", IMPLS)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,block", [(1, 200, 320, (128, 128)), (3, 200, 320, (128, 128)),
                                         (17, 200, 320, (128, 128)), (17, 48, 200, (32, 64))])
def test_fp8_block_matmul_equals_float64(use_triton, out_dtype, m, n, k, block):
    """N and K off the blocks (the last blocks partial), both scales per block."""
    x_q, x_scale, w_q, w_scale = _block_case(m, n, k, block, seed=m + n + k)
    want, mag = _block_truth(x_q, x_scale, w_q, w_scale, *block)
    got = Q.fp8_block_matmul(x_q, x_scale, w_q, w_scale, block, out_dtype, use_triton=use_triton)
    assert got.dtype == out_dtype and got.shape == (m, n)
    _assert_within(got, want, mag, (k + 4) * EPS32)


@pytest.mark.parametrize("use_triton", IMPLS)
def test_fp8_block_matmul_applies_each_scale_to_its_own_block(use_triton):
    """x of ones, w of ones: y[m, n] = sum over K blocks of (block width) * x_scale * w_scale,
    so a scale applied to a neighbour's block shows at once."""
    m, n, k, bn, bk = 3, 40, 80, 16, 32
    x_q, w_q = torch.ones(m, k).to(E4M3), torch.ones(n, k).to(E4M3)
    x_scale = torch.tensor([[1.0, 2.0, 4.0], [8.0, 16.0, 32.0], [64.0, 128.0, 256.0]])
    w_scale = 2.0 ** torch.arange(9, dtype=torch.float32).view(3, 3) / 2**20
    got = Q.fp8_block_matmul(x_q, x_scale, w_q, w_scale, (bn, bk), torch.float32, use_triton=use_triton)
    widths = torch.tensor([32.0, 32.0, 16.0])
    want = torch.einsum("mb,nb,b->mn", x_scale.double(), w_scale.double().repeat_interleave(bn, 0)[:n], widths.double())
    assert torch.equal(got.double(), want)  # powers of two times small integers: exact


# --- FP8 per-tensor / per-channel matmul -------------------------------------------------------

SCALINGS = {  # name -> (x_scale of [M, K], w_scale of [N, K])
    "tensor-tensor": (lambda m, g: torch.tensor(0.03), lambda n, g: torch.tensor(0.002)),
    "tensor1-channel": (lambda m, g: torch.tensor([0.03]), lambda n, g: torch.rand(n, generator=g) * 1e-2),
    "token-tensor1": (lambda m, g: torch.rand(m, 1, generator=g) + 0.01, lambda n, g: torch.tensor([0.002])),
    "token-channel": (lambda m, g: torch.rand(m, 1, generator=g) + 0.01, lambda n, g: torch.rand(n, 1, generator=g)),
}


@pytest.mark.parametrize("use_triton", IMPLS)
@pytest.mark.parametrize("scaling", list(SCALINGS))
@pytest.mark.parametrize("m,bias", [(1, False), (3, True), (17, True)])
def test_fp8_scaled_matmul_equals_float64(use_triton, scaling, m, bias):
    n, k = 200, 320
    g = torch.Generator().manual_seed(m)
    x_q, w_q = _fp8_values(g, (m, k)), _fp8_values(g, (n, k))
    xs_fn, ws_fn = SCALINGS[scaling]
    x_scale, w_scale = xs_fn(m, g), ws_fn(n, g)
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    got = Q.fp8_scaled_matmul(x_q, x_scale, w_q, w_scale, torch.bfloat16, b, use_triton=use_triton)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    s = x_scale.double().reshape(-1, 1) * w_scale.double().reshape(1, -1)
    want = (x_q.double() @ w_q.double().T) * s + (b.double() if bias else 0.0)
    mag = (x_q.double().abs() @ w_q.double().abs().T) * s + (b.double().abs() if bias else 0.0)
    _assert_within(got, want, mag, (k + 4) * EPS32)


# --- int4 weight-only ----------------------------------------------------------------------------


def test_the_packed_layout_nibble_by_nibble():
    q = torch.tensor([[1], [2], [3], [4], [5], [6], [7], [15], [9], [10]])  # K = 10: 2 packed rows
    packed = I4.pack_int4(q)
    assert packed.dtype == torch.int32 and packed.shape == (2, 1)
    assert int(packed[0, 0]) == 0xF7654321 - 2**32  # row 8j + i in bits 4i..4i+3
    assert int(packed[1, 0]) == 0xA9  # rows past K are zeros
    assert torch.equal(I4.unpack_int4(packed, 10), q.to(torch.uint8))


def test_the_8_bit_layout_byte_by_byte():
    q = torch.tensor([[1], [0x23], [0x45], [0xF7], [0x89], [0xAB]])  # K = 6: 2 packed rows of 4
    packed = I4.pack_int4(q, bits=8)
    assert packed.dtype == torch.int32 and packed.shape == (2, 1)
    assert int(packed[0, 0]) == 0xF7452301 - 2**32  # row 4j + i in bits 8i..8i+7
    assert int(packed[1, 0]) == 0xAB89  # rows past K are zeros
    assert torch.equal(I4.unpack_int4(packed, 6, bits=8), q.to(torch.uint8))
    with pytest.raises(ValueError, match="^q:"):
        I4.pack_int4(q, bits=4)
    with pytest.raises(ValueError, match="^bits:"):
        I4.pack_int4(q, bits=6)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k,n", [(200, 48), (203, 5), (8, 1)])
def test_pack_unpack_round_trip(k, n, bits):
    q = torch.randint(0, 1 << bits, (k, n), generator=torch.Generator().manual_seed(k))
    assert torch.equal(I4.unpack_int4(I4.pack_int4(q, bits), k, bits), q.to(torch.uint8))


def _int4_case(m: int, n: int, k: int, group: int, dtype: torch.dtype, symmetric: bool, seed: int, bits: int = 4):
    g = torch.Generator().manual_seed(seed)
    rows = k if group == -1 else group
    groups = _cdiv(k, rows)
    top = 1 << bits
    q = torch.randint(0, top, (k, n), generator=g)
    scales = ((torch.rand(groups, n, generator=g) + 0.05) * 0.02 * 16 / top).to(dtype)
    zeros = torch.full((groups, n), top // 2, dtype=torch.int32) if symmetric else torch.randint(
        0, top, (groups, n), generator=g, dtype=torch.int32)
    x = torch.randn(m, k, generator=g).to(dtype)
    idx = torch.arange(k) // rows
    w = (q.double() - zeros.double()[idx]) * scales.double()[idx]  # [K, N], the layout's meaning
    return x, I4.pack_int4(q, bits), scales, zeros, w


@pytest.mark.parametrize("bits", [4, 8])
def test_dequantize_int4_is_the_layouts_meaning(bits):
    x, qweight, scales, zeros, w = _int4_case(1, 48, 200, 64, torch.float64, False, 1, bits)
    assert torch.equal(I4.dequantize_int4(qweight, scales, zeros, 64, 200, torch.float64, bits=bits), w.T)


@pytest.mark.parametrize("use_triton", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,group,symmetric,bits", [(1, 48, 200, 64, False, 4), (3, 48, 200, 32, True, 4),
                                                        (17, 48, 256, 128, False, 4), (17, 40, 200, -1, False, 4),
                                                        (3, 48, 203, 64, True, 4), (1, 48, 200, 64, False, 8),
                                                        (3, 48, 203, 32, True, 8), (17, 40, 256, -1, False, 8)])
def test_int4_matmul_equals_float64(use_triton, dtype, m, n, k, group, symmetric, bits):
    """K off the group size (a partial last group), one group of all K, K not a multiple of the
    codes per word; 4 and 8 bits."""
    x, qweight, scales, zeros, w = _int4_case(m, n, k, group, dtype, symmetric, seed=m + k, bits=bits)
    bias = torch.randn(n).to(dtype) if m == 3 else None
    got = I4.int4_dequant_matmul(x, qweight, scales, zeros, group, bias, bits=bits, use_triton=use_triton)
    assert got.dtype == dtype and got.shape == (m, n)
    want = x.double() @ w + (bias.double() if bias is not None else 0.0)
    mag = x.double().abs() @ w.abs() + (bias.double().abs() if bias is not None else 0.0)
    rel = (k + 4) * EPS32 + (2.0**-8 if dtype == torch.bfloat16 else 0.0)  # W rounded to bfloat16
    _assert_within(got, want, mag, rel)


@pytest.mark.parametrize("use_triton", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,group,bits", [(1, 48, 256, 64, 4), (17, 40, 200, 32, 4), (3, 48, 384, 128, 4),
                                               (17, 40, 200, 32, 8)])
def test_int4_matmul_in_activation_order_equals_float64(use_triton, dtype, m, n, k, group, bits):
    """GPTQ's activation order: each input row's group from `g_idx` (groups of `group` rows in a
    permuted order, so a K tile holds rows of many groups), not row // group."""
    x, qweight, scales, zeros, _ = _int4_case(m, n, k, group, dtype, False, seed=m + k, bits=bits)
    g = torch.Generator().manual_seed(k)
    g_idx = (torch.randperm(k, generator=g) // group).to(torch.int32)  # GPTQ's: invperm // group
    q = I4.unpack_int4(qweight, k, bits).double()
    w = (q - zeros.double()[g_idx.long()]) * scales.double()[g_idx.long()]
    assert torch.equal(I4.dequantize_int4(qweight, scales, zeros, 0, k, torch.float64, g_idx, bits), w.T)
    got = I4.int4_dequant_matmul(x, qweight, scales, zeros, 0, None, g_idx, bits, use_triton=use_triton)
    rel = (k + 4) * EPS32 + (2.0**-8 if dtype == torch.bfloat16 else 0.0)
    _assert_within(got, x.double() @ w, x.double().abs() @ w.abs(), rel)


# --- bad arguments ---------------------------------------------------------------------------------


def _bad_calls():
    xq, wq = torch.zeros(3, 64).to(E4M3), torch.zeros(32, 64).to(E4M3)
    xs, ws = torch.ones(3, 1), torch.ones(1, 1)
    qw, sc, z = torch.zeros(8, 4, dtype=torch.int32), torch.ones(1, 4), torch.zeros(1, 4, dtype=torch.int32)
    x = torch.zeros(3, 64)
    return {
        "x_q": lambda t: Q.fp8_block_matmul(xq.float(), xs, wq, ws, (128, 128), torch.float32, use_triton=t),
        "w_scale": lambda t: Q.fp8_block_matmul(xq, xs, wq, torch.ones(2, 1), (128, 128), torch.float32, use_triton=t),
        "block": lambda t: Q.fp8_block_matmul(xq, xs, wq, ws, (128, 0), torch.float32, use_triton=t),
        "x_scale": lambda t: Q.fp8_scaled_matmul(xq, torch.ones(3), wq, ws[0, 0], torch.float32, use_triton=t),
        "w_q": lambda t: Q.fp8_scaled_matmul(xq, xs, wq.to(E5M2), ws[0, 0], torch.float32, use_triton=t),
        "group": lambda t: Q.per_token_group_quant_fp8(x, 0, use_triton=t),
        "dtype": lambda t: Q.per_token_group_quant_fp8(x, 128, torch.bfloat16, use_triton=t),
        "amax_ub": lambda t: Q.per_token_quant_fp8(x, amax_ub=0.0, use_triton=t),
        "min_scale": lambda t: Q.per_token_quant_fp8(x, min_scale=-1.0, use_triton=t),
        "qweight": lambda t: I4.int4_dequant_matmul(x, qw[:7], sc, z, -1, use_triton=t),
        "zeros": lambda t: I4.int4_dequant_matmul(x, qw, sc, z.float(), -1, use_triton=t),
        "scales": lambda t: I4.int4_dequant_matmul(x, qw, sc, z, 32, use_triton=t),
        "group_size": lambda t: I4.int4_dequant_matmul(x, qw, sc, z, 0, use_triton=t),
        "bias": lambda t: I4.int4_dequant_matmul(x, qw, sc, z, -1, torch.zeros(5), use_triton=t),
    }


test_a_bad_argument_is_named = bad_argument_test(_bad_calls)


@interpreted_only
def test_the_kernel_refuses_a_k_block_it_cannot_tile():
    x_q, x_scale, w_q, w_scale = _block_case(2, 16, 48, (16, 24), seed=0)
    with pytest.raises(ValueError, match="^block:"):
        Q.fp8_block_matmul(x_q, x_scale, w_q, w_scale, (16, 24), torch.float32, use_triton=True)


# --- compiled, at a real layer's size --------------------------------------------------------------
# FP8 operands here are small integers, so every tile's FP8 product sums exactly (|sum| < 2^11)
# however the tensor cores add (an H100/H200 adds FP8 products in about 14 bits): the bound is
# the float32 one above, and a wrong scale, block or mask shows as an error of the size of y.
GPU_SHAPES = [(1, 4096, 4096), (64, 4096, 4096), (17, 1000, 1000)]


def _small_ints(g: torch.Generator, shape: tuple[int, int], top: int) -> torch.Tensor:
    return torch.randint(-top, top + 1, shape, device="cuda", generator=g).float().to(E4M3)


@pytest.mark.gpu
@compiled_only
@pytest.mark.parametrize("m,n,k", GPU_SHAPES)
def test_gpu_fp8_kernels(m, n, k):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9")
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16) * 3
    x_q, x_scale = Q.per_token_group_quant_fp8(x, 128)
    ref_q, ref_s = Q.per_token_group_quant_fp8_reference(x, 128)
    assert torch.equal(x_scale, ref_s) and _same_bits(x_q, ref_q)
    x_q, w_q = _small_ints(g, (m, k), 3), _small_ints(g, (n, k), 4)
    w_scale = torch.rand(_cdiv(n, 128), _cdiv(k, 128), device="cuda", generator=g) * 1e-2 + 1e-4
    got = Q.fp8_block_matmul(x_q, x_scale, w_q, w_scale, (128, 128), torch.bfloat16)
    want, mag = _block_truth(x_q, x_scale, w_q, w_scale, 128, 128)
    _assert_within(got, want, mag, (k + 4) * EPS32)
    xs, ws = torch.rand(m, 1, device="cuda", generator=g) + 0.01, torch.rand(n, device="cuda", generator=g) * 1e-2
    bias = torch.randn(n, device="cuda", generator=g, dtype=torch.bfloat16)
    got = Q.fp8_scaled_matmul(x_q, xs, w_q, ws, torch.bfloat16, bias)
    s = xs.double() * ws.double()[None, :]
    want = (x_q.double() @ w_q.double().T) * s + bias.double()
    mag = (x_q.double().abs() @ w_q.double().abs().T) * s + bias.double().abs()
    _assert_within(got, want, mag, (k + 4) * EPS32)


@pytest.mark.gpu
@compiled_only
@pytest.mark.parametrize("m,n,k", GPU_SHAPES)
@pytest.mark.parametrize("group,bits", [(128, 4), (-1, 4), (128, 8)])
def test_gpu_int4_kernel(m, n, k, group, bits):
    x, qweight, scales, zeros, w = _int4_case(m, n, k, group, torch.bfloat16, False, seed=m, bits=bits)
    x, qweight, scales, zeros, w = (t.cuda() for t in (x, qweight, scales, zeros, w))
    got = I4.int4_dequant_matmul(x, qweight, scales, zeros, group, bits=bits)
    _assert_within(got, x.double() @ w, x.double().abs() @ w.abs(), 2.0**-8 + (k + 4) * EPS32)


@pytest.mark.gpu
@compiled_only
@pytest.mark.parametrize("m,n,k", GPU_SHAPES)
def test_gpu_int4_kernel_in_activation_order(m, n, k):
    x, qweight, scales, zeros, _ = _int4_case(m, n, k, 128, torch.bfloat16, False, seed=m)
    g_idx = (torch.randperm(k, generator=torch.Generator().manual_seed(k)) // 128).to(torch.int32)
    w = (I4.unpack_int4(qweight, k).double() - zeros.double()[g_idx.long()]) * scales.double()[g_idx.long()]
    got = I4.int4_dequant_matmul(x.cuda(), qweight.cuda(), scales.cuda(), zeros.cuda(), 0, None, g_idx.cuda())
    _assert_within(got.cpu(), x.double() @ w, x.double().abs() @ w.abs(), 2.0**-8 + (k + 4) * EPS32)
