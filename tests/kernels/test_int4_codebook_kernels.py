"""The packed 4-bit layout with a codebook (bitsandbytes' NF4 / FP4 kept packed): W[n, k] =
codebook[q[k, n]] * scales[k // G, n], no zeros (batonlm/kernels/int4.py), the torch reference
and the Triton kernel (interpreted here; compiled in the `gpu` test) against float64.

Bounds (u = 2^-24, eps = 2u): each weight is one float32 product of two float32 values, so
|fl(c s) - c s| <= u |c s|; the float32 sum of K products errs by at most K u sum |x||w|, so
(K + 4) eps sum |x||w| holds with the bias and output rounding, as for the integer layout; with
bfloat16 activations W is rounded to bfloat16 (2^-8 |w| more) and the output too (eps |y|).

NVFP4 kept packed stores its group scales as float8 e4m3 (1 byte per 16 weights) with a float32
factor per output column (`scale_2`): a group's scale is then the float32 product of the two,
rounded once, and the weight one more float32 product; the same bounds hold with the scale's
rounding (u more per weight).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_helpers import IMPLS, compiled_only  # noqa: E402

from batonlm.kernels import int4 as Q  # noqa: E402

EPS32 = torch.finfo(torch.float32).eps


def _codebook(g: torch.Generator) -> torch.Tensor:
    """16 distinct values in [-1, 1], unevenly spaced (as NF4's normal quantiles are), 0 among them."""
    values = torch.rand(15, generator=g) * 2 - 1
    return torch.cat([values, torch.zeros(1)]).sort().values


def _case(m: int, n: int, k: int, group: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    groups = -(-k // (k if group == -1 else group))
    q = torch.randint(0, 16, (k, n), generator=g)
    scales = (torch.rand(groups, n, generator=g) + 0.05).float()  # bitsandbytes' absmax: float32
    codebook = _codebook(g)
    x = torch.randn(m, k, generator=g).to(dtype)
    idx = torch.arange(k) // (k if group == -1 else group)
    w = codebook.double()[q] * scales.double()[idx]  # [K, N]: the layout's meaning
    return x, Q.pack_int4(q), scales, codebook, w


def _fp8_case(m: int, n: int, k: int, group: int, dtype: torch.dtype, seed: int, divides: bool = False):
    """As `_case`, with float8 e4m3 group scales and a float32 per-tensor scale per column, which
    multiplies them (ModelOpt's) or divides them (compressed-tensors' global scale)."""
    x, qweight, scales, codebook, _ = _case(m, n, k, group, dtype, seed)
    fp8 = (scales * 448).to(torch.float8_e4m3fn)
    scale_2 = (torch.rand(n, generator=torch.Generator().manual_seed(seed + 1)) + 0.5) / 448
    if divides:
        scale_2 = 1 / scale_2
    idx = torch.arange(k) // group
    q = Q.unpack_int4(qweight, k).long()
    scale = fp8.float() / scale_2 if divides else fp8.float() * scale_2  # rounded once to float32
    return x, qweight, fp8, scale_2, codebook, codebook.double()[q] * scale.double()[idx]


def _assert_within(got: torch.Tensor, want: torch.Tensor, mag: torch.Tensor, rel: float) -> None:
    bound = rel * mag + torch.finfo(got.dtype).eps * want.abs() + 1e-30
    err = (got.double() - want).abs()
    assert bool((err <= bound).all()), f"max err/bound {float((err / bound).max()):.3g}"


def test_dequantize_with_a_codebook_is_one_float32_product_per_weight():
    """codebook[q] * scale rounded once to float32, as bitsandbytes' dequantize_4bit computes it
    (the layer's float32 weights are then bit for bit the dequantized checkpoint's)."""
    _, qweight, scales, codebook, w = _case(1, 48, 200, 64, torch.float32, seed=1)
    got = Q.dequantize_int4(qweight, scales, None, 64, 200, torch.float32, codebook=codebook)
    assert torch.equal(got, w.T.float())
    as_float64 = Q.dequantize_int4(qweight, scales, None, 64, 200, torch.float64, codebook=codebook)
    assert torch.equal(as_float64, w.T)


@pytest.mark.parametrize("use_triton", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,group", [(1, 48, 256, 64), (3, 40, 200, 64), (17, 48, 384, 128), (5, 33, 203, 32),
                                         (2, 48, 200, -1)])
def test_codebook_matmul_equals_float64(use_triton, dtype, m, n, k, group):
    """Groups a tile holds whole (64, 128) and partial ones (32 with K = 203: a partial last group
    and word), one group of all K; odd N."""
    x, qweight, scales, codebook, w = _case(m, n, k, group, dtype, seed=m + k)
    bias = torch.randn(n).to(dtype) if m == 3 else None
    got = Q.int4_dequant_matmul(x, qweight, scales, None, group, bias, codebook=codebook, use_triton=use_triton)
    assert got.dtype == dtype and got.shape == (m, n)
    want = x.double() @ w + (bias.double() if bias is not None else 0.0)
    mag = x.double().abs() @ w.abs() + (bias.double().abs() if bias is not None else 0.0)
    _assert_within(got, want, mag, (k + 4) * EPS32 + (2.0**-8 if dtype == torch.bfloat16 else 0.0))


@pytest.mark.parametrize("divides", [False, True])
def test_dequantize_with_float8_scales_and_a_column_factor(divides):
    """NVFP4's layout: codebook[q] * float32(fp8 scale * or / the column's per-tensor scale), each
    rounded once to float32; a float64 result the same (the scale's float32 value is the format's)."""
    _, qweight, fp8, scale_2, codebook, w = _fp8_case(1, 40, 200, 16, torch.float32, seed=3, divides=divides)
    for dtype, want in ((torch.float32, w.T.float()), (torch.float64, w.T)):
        assert torch.equal(Q.dequantize_int4(qweight, fp8, None, 16, 200, dtype, codebook=codebook, scale_2=scale_2,
                                             scale_2_divides=divides), want)


@pytest.mark.parametrize("use_triton", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,group,divides", [(1, 48, 256, 16, False), (3, 33, 200, 16, True),
                                                (5, 40, 256, 64, False), (2, 40, 256, 64, True)])
def test_float8_scales_matmul_equals_float64(use_triton, dtype, m, n, k, group, divides):
    """Groups of 16 (several in a K tile, the last partial with K = 200; odd N) and of 64 (a
    tile's one row of scales); the per-tensor scale multiplying or dividing."""
    x, qweight, fp8, scale_2, codebook, w = _fp8_case(m, n, k, group, dtype, seed=m + k, divides=divides)
    got = Q.int4_dequant_matmul(x, qweight, fp8, None, group, codebook=codebook, scale_2=scale_2,
                                scale_2_divides=divides, use_triton=use_triton)
    assert got.dtype == dtype and got.shape == (m, n)
    _assert_within(got, x.double() @ w, x.double().abs() @ w.abs(),
                   (k + 4) * EPS32 + (2.0**-8 if dtype == torch.bfloat16 else 0.0))
    without = Q.int4_dequant_matmul(x, qweight, fp8.float(), None, group, codebook=codebook, use_triton=use_triton)
    assert (without.double() - x.double() @ w).abs().max() > 100 * (x.double() @ w).abs().max()  # factor applied


@pytest.mark.parametrize("use_triton", IMPLS)
@pytest.mark.parametrize("m,n,k", [(1, 48, 256), (5, 33, 200)])
def test_e8m0_exponent_scales_equal_float64(use_triton, m, n, k):
    """MXFP4's layout: uint8 exponents e per group of 32, the scale 2^(e - 127) (e = 0: 2^-127, a
    subnormal), exact; the kernel builds it from the exponent's bits."""
    x, qweight, _, codebook, _ = _case(m, n, k, 32, torch.float32, seed=m + k)
    g = torch.Generator().manual_seed(k)
    exponents = torch.randint(118, 136, (-(-k // 32), n), generator=g, dtype=torch.uint8)
    exponents[0, 0] = 0
    scales = torch.ldexp(torch.ones(exponents.shape, dtype=torch.float64), exponents.long() - 127)
    q = Q.unpack_int4(qweight, k).long()
    w = codebook.double()[q] * scales[torch.arange(k) // 32]
    assert torch.equal(Q.dequantize_int4(qweight, exponents, None, 32, k, torch.float64, codebook=codebook), w.T)
    got = Q.int4_dequant_matmul(x, qweight, exponents, None, 32, codebook=codebook, use_triton=use_triton)
    _assert_within(got, x.double() @ w, x.double().abs() @ w.abs(), (k + 4) * EPS32)


def _fp8_table_case(m: int, n: int, k: int, group: int, dtype: torch.dtype, seed: int):
    """FP8 weight-only kept packed: every e4m3 byte an 8-bit code (NaN codes left out), its value
    from the 256-entry table of e4m3 values, a float32 scale per column and group of `group` rows
    (one 128x128 block's scale on each of its columns)."""
    from batonlm.model_runner.quantization.fp8_weight_only import codebook

    g = torch.Generator().manual_seed(seed)
    table = codebook("F8_E4M3")
    q = torch.randint(0, 256, (k, n), generator=g)
    q[q.remainder(128) == 127] = 0  # 0x7F, 0xFF: NaN
    groups = -(-k // (k if group == -1 else group))
    scales = (torch.rand(groups, n, generator=g) + 0.05) / 448
    x = torch.randn(m, k, generator=g).to(dtype)
    w = table.double()[q] * scales.double()[torch.arange(k) // (k if group == -1 else group)]
    return x, Q.pack_int4(q, 8), scales, table, w


@pytest.mark.parametrize("use_triton", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,group", [(1, 48, 256, 128), (3, 33, 200, 128), (5, 40, 256, -1)])
def test_eight_bit_codes_through_the_fp8_table_equal_float64(use_triton, dtype, m, n, k, group):
    """8-bit codes with a 256-entry codebook (FP8 weight-only: ModelOpt's FP8_PB_WO): blocks of 128
    (a partial last one with K = 200; odd N), one group of all K."""
    x, qweight, scales, table, w = _fp8_table_case(m, n, k, group, dtype, seed=m + k)
    assert torch.equal(Q.dequantize_int4(qweight, scales, None, group, k, torch.float64, bits=8, codebook=table), w.T)
    got = Q.int4_dequant_matmul(x, qweight, scales, None, group, bits=8, codebook=table, use_triton=use_triton)
    assert got.dtype == dtype and got.shape == (m, n)
    _assert_within(got, x.double() @ w, x.double().abs() @ w.abs(),
                   (k + 4) * EPS32 + (2.0**-8 if dtype == torch.bfloat16 else 0.0))


@pytest.mark.parametrize("use_triton", IMPLS)
@pytest.mark.parametrize("m,n,k", [(1, 48, 256), (5, 33, 200)])
def test_mxfp8_weights_eight_bit_codes_with_e8m0_exponents(use_triton, m, n, k):
    """MXFP8 kept packed: the FP8 table's 8-bit codes with a uint8 E8M0 exponent per 32 inputs
    (2^(e - 127), exact), the last group partial with K = 200."""
    x, qweight, _, table, _ = _fp8_table_case(m, n, k, 32, torch.float32, seed=m + k)
    exponents = torch.randint(118, 136, (-(-k // 32), n), generator=torch.Generator().manual_seed(n), dtype=torch.uint8)
    q = Q.unpack_int4(qweight, k, 8).long()
    w = table.double()[q] * torch.ldexp(torch.ones(exponents.shape, dtype=torch.float64),
                                        exponents.long() - 127)[torch.arange(k) // 32]
    assert torch.equal(Q.dequantize_int4(qweight, exponents, None, 32, k, torch.float64, bits=8, codebook=table), w.T)
    got = Q.int4_dequant_matmul(x, qweight, exponents, None, 32, bits=8, codebook=table, use_triton=use_triton)
    _assert_within(got, x.double() @ w, x.double().abs() @ w.abs(), (k + 4) * EPS32)


@pytest.mark.parametrize("use_triton", IMPLS)
def test_the_codebook_is_read_code_by_code(use_triton):
    """A permuted codebook gives other weights: the kernel reads each code's own entry (the
    integer meaning (q - 8) * s, or a fixed table, would not notice)."""
    x, qweight, scales, codebook, w = _case(4, 32, 128, 64, torch.float32, seed=7)
    flipped = codebook.flip(0).contiguous()
    got = Q.int4_dequant_matmul(x, qweight, scales, None, 64, codebook=flipped, use_triton=use_triton)
    q = Q.unpack_int4(qweight, 128).long()
    want = x.double() @ (flipped.double()[q] * scales.double()[torch.arange(128) // 64])
    _assert_within(got, want, x.double().abs() @ w.abs(), 132 * EPS32)
    assert (got.double() - x.double() @ w).abs().max() > 0.1


@pytest.mark.parametrize("use_triton", IMPLS)
@pytest.mark.parametrize("codebook,zeros,match", [
    (torch.zeros(16, dtype=torch.float64), None, "^codebook: .*float32 \\[16\\]"),
    (torch.zeros(8), None, "^codebook: "),
    (None, None, "^zeros: .*got None"),
])
def test_a_bad_codebook_or_missing_zeros_is_named(use_triton, codebook, zeros, match):
    x, qw, sc = torch.zeros(3, 64), torch.zeros(8, 4, dtype=torch.int32), torch.ones(1, 4)
    with pytest.raises(ValueError, match=match):
        Q.int4_dequant_matmul(x, qw, sc, zeros, -1, codebook=codebook, use_triton=use_triton)


@pytest.mark.parametrize("use_triton", IMPLS)
@pytest.mark.parametrize("scale_2", [torch.ones(4, dtype=torch.float64), torch.ones(5), torch.ones(1, 4)])
def test_a_bad_column_factor_is_named(use_triton, scale_2):
    x, qw, sc = torch.zeros(3, 64), torch.zeros(8, 4, dtype=torch.int32), torch.ones(1, 4)
    with pytest.raises(ValueError, match=r"^scale_2: .*float32 \[4\]"):
        Q.int4_dequant_matmul(x, qw, sc, None, -1, codebook=torch.zeros(16), scale_2=scale_2, use_triton=use_triton)


@pytest.mark.gpu
@compiled_only
@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (64, 4096, 4096), (17, 1000, 1000)])
@pytest.mark.parametrize("group", [64, 32, 16])
def test_gpu_codebook_kernel(m, n, k, group):
    x, qweight, scales, codebook, w = _case(m, n, k, group, torch.bfloat16, seed=m)
    got = Q.int4_dequant_matmul(x.cuda(), qweight.cuda(), scales.cuda(), None, group, codebook=codebook.cuda())
    _assert_within(got.cpu(), x.double() @ w, x.double().abs() @ w.abs(), 2.0**-8 + (k + 4) * EPS32)
    for divides in (False, True):  # NVFP4's scales, ModelOpt's and compressed-tensors'
        x, qweight, fp8, scale_2, codebook, w = _fp8_case(m, n, k, group, torch.bfloat16, seed=m, divides=divides)
        got = Q.int4_dequant_matmul(x.cuda(), qweight.cuda(), fp8.cuda(), None, group, codebook=codebook.cuda(),
                                    scale_2=scale_2.cuda(), scale_2_divides=divides)
        _assert_within(got.cpu(), x.double() @ w, x.double().abs() @ w.abs(), 2.0**-8 + (k + 4) * EPS32)
    if group == 64:  # FP8 weight-only: 8-bit codes through the e4m3 table, blocks of 128
        x, qweight, scales, table, w = _fp8_table_case(m, n, k, 128, torch.bfloat16, seed=m)
        got = Q.int4_dequant_matmul(x.cuda(), qweight.cuda(), scales.cuda(), None, 128, bits=8, codebook=table.cuda())
        _assert_within(got.cpu(), x.double() @ w, x.double().abs() @ w.abs(), 2.0**-8 + (k + 4) * EPS32)
        # MXFP8: the same codes with E8M0 exponents per 32
        exponents = torch.randint(118, 136, (-(-k // 32), n), generator=torch.Generator().manual_seed(k),
                                  dtype=torch.uint8)
        q = Q.unpack_int4(qweight, k, 8).long()
        w = table.double()[q] * torch.ldexp(torch.ones(exponents.shape, dtype=torch.float64),
                                            exponents.long() - 127)[torch.arange(k) // 32]
        got = Q.int4_dequant_matmul(x.cuda(), qweight.cuda(), exponents.cuda(), None, 32, bits=8,
                                    codebook=table.cuda())
        _assert_within(got.cpu(), x.double() @ w, x.double().abs() @ w.abs(), 2.0**-8 + (k + 4) * EPS32)
    if group == 32:  # MXFP4's E8M0 exponents
        exponents = torch.randint(118, 136, (-(-k // 32), n), generator=torch.Generator().manual_seed(k),
                                  dtype=torch.uint8)
        q = Q.unpack_int4(qweight, k).long()
        w = codebook.double()[q] * torch.ldexp(torch.ones(exponents.shape, dtype=torch.float64),
                                               exponents.long() - 127)[torch.arange(k) // 32]
        got = Q.int4_dequant_matmul(x.cuda(), qweight.cuda(), exponents.cuda(), None, 32, codebook=codebook.cuda())
        _assert_within(got.cpu(), x.double() @ w, x.double().abs() @ w.abs(), 2.0**-8 + (k + 4) * EPS32)
