"""MXFP8 activation quantization (batonlm/kernels/mxfp8.py), each tool's arithmetic against its
definition computed in float64: per group of 32 inputs a power-of-two scale 2^e, the values
x / 2^e rounded to e4m3 (exact division: the only rounding is e4m3's, so the dequantized value
is within half an e4m3 step, 2^-4 relative, of x unless it saturates at 448 * 2^e).

- ModelOpt: e = ceil(log2(fl32(amax / 448))) in [-127, 127];
- compressed-tensors: e = floor(log2(amax)) - 8, one more where amax's mantissa is >= 1.75.
The two agree except at a mantissa of exactly 1.75 (amax = 448 * 2^(p - 8)). The torch
references and the Triton kernel (interpreted here; compiled in the `gpu` test) alike: the
kernel is the reference bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from kernel_helpers import IMPLS, compiled_only, interpreted_only  # noqa: E402

from batonlm.kernels import mxfp8 as M  # noqa: E402


def _inputs(seed: int, rows: int = 9, k: int = 96) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * 2.0 ** torch.randint(-30, 30, (rows, 1), generator=g)
    x[0, :32] = 0.0  # an all-zero group
    ramp = torch.linspace(-1, 1, 32)
    x[1, :32], x[1, 3] = ramp * 3, 448 * 2.0**-6  # amax / 448 a power of two: mantissa exactly 1.75
    x[1, 5] = 1.15 * 2.0**-12  # (9 e4m3 steps of 2^-15 at ModelOpt's scale, 4.6 -> 5 of 2^-14 at the other)
    x[2, 32:64], x[2, 40] = ramp * 50, 1.7499 * 2.0**5  # just under 1.75
    x[3, 64:96], x[3, 70] = ramp * 2.0**-10, 1.7501 * 2.0**-9  # just over
    return x


def _exponents(x: torch.Tensor, tool: str) -> list[list[int]]:
    out = []
    for row in x.double():
        es = []
        for g0 in range(0, row.numel(), 32):
            amax = float(row[g0 : g0 + 32].abs().max())
            if amax == 0:
                es.append(-127)
            elif tool == "modelopt":
                descale = float(torch.tensor(amax, dtype=torch.float32) / torch.tensor(448.0))
                es.append(max(-127, min(127, math.ceil(math.log2(descale)))))
            else:
                m, p = math.frexp(amax)  # amax = m 2^p, m in [0.5, 1)
                es.append(max(-127, min(128, (p - 1) + (1 if 2 * m >= 1.75 else 0) - 8)))
        out.append(es)
    return out


@pytest.mark.parametrize("use_triton", IMPLS)
@pytest.mark.parametrize("tool", ["modelopt", "compressed-tensors"])
def test_each_group_is_scaled_by_its_tools_power_of_two(tool: str, use_triton: bool) -> None:
    x = _inputs(1)
    got = M.MX_INPUTS[tool](x, use_triton=use_triton)
    assert got.dtype == x.dtype and got.shape == x.shape
    es = torch.tensor(_exponents(x, tool), dtype=torch.float64).repeat_interleave(32, dim=1)
    scale = torch.exp2(es)
    want = (x.double() / scale).clamp(-448, 448).to(torch.float8_e4m3fn).double() * scale
    assert torch.equal(got.double(), want)
    assert torch.equal(got[0, :32], torch.zeros(32))
    # within half an e4m3 step of each input (its subnormal step 2^-9 * 2^e below 2^-6 * 2^e)
    err = (got.double() - x.double()).abs()
    assert bool((err <= 2.0**-4 * x.double().abs() + 2.0**-10 * scale).all())


@pytest.mark.parametrize("use_triton", IMPLS)
def test_the_tools_part_only_where_amax_is_448_times_a_power_of_two(use_triton: bool) -> None:
    x = _inputs(2)
    mo, ct = (torch.tensor(_exponents(x, t)) for t in ("modelopt", "compressed-tensors"))
    differ = (mo != ct).nonzero().tolist()
    assert differ == [[1, 0]]  # row 1's first group: amax = 1.75 * 2^2
    assert mo[1, 0] == ct[1, 0] - 1
    a, b = M.modelopt_mxfp8_fake_quant(x, use_triton=use_triton), M.ct_mxfp8_fake_quant(x, use_triton=use_triton)
    assert torch.equal(a[:, 32:], b[:, 32:]) and torch.equal(a[2:], b[2:]) and not torch.equal(a[1, :32], b[1, :32])


@pytest.mark.parametrize("use_triton", IMPLS)
@pytest.mark.parametrize("tool", ["modelopt", "compressed-tensors"])
def test_bfloat16_inputs_and_a_partial_group(tool: str, use_triton: bool) -> None:
    """bfloat16 in, bfloat16 out (MXFP8 values are exact in bfloat16), the same values as from
    float32; K = 40: a last group of 8 scaled by its own amax."""
    quant = M.MX_INPUTS[tool]
    x = _inputs(3)[:, :40].bfloat16()
    got = quant(x, use_triton=use_triton)
    assert got.dtype == torch.bfloat16 and torch.equal(got.float(), quant(x.float(), use_triton=use_triton))
    tail = x[:, 32:].float()
    alone = quant(torch.cat([tail, torch.zeros(tail.shape[0], 24)], dim=1), use_triton=use_triton)[:, :8]
    assert torch.equal(got[:, 32:].float(), alone)


def _extremes(dtype: torch.dtype) -> torch.Tensor:
    """Rows over float32's whole range: huge and tiny groups, subnormal amaxes (ModelOpt's amax /
    448 below 2^-126 on both sides of 2^-127), zeros, values rounding to e4m3's subnormals and to
    the next power of two, ties; bfloat16 and 3-D too."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(40, 224, generator=g) * 2.0 ** torch.randint(-120, 100, (40, 7), generator=g).repeat_interleave(32, 1)
    x[0, :32] = 0.0
    x[1, :32] = torch.linspace(-1, 1, 32) * 2.0**-130  # a subnormal amax
    x[2, :32], x[2, 0] = torch.linspace(-1, 1, 32) * 2.0**-118, 448 * 2.0**-126.5  # amax / 448 in (2^-127, 2^-126)
    x[3, :32] = torch.arange(32) * 2.0**-10 * 2.0**-3  # multiples of e4m3's subnormal step, ties among them
    x[4, :32] = 1.9375 + torch.arange(32) * 2.0**-10  # rounding up into the next power of two
    return x.to(dtype)


# The kernel interpreted on the CPU, or compiled on CUDA (the `gpu` test, at a prefill's size too).
KERNELS = [pytest.param("cpu", id="interpreted", marks=interpreted_only),
           pytest.param("cuda", id="gpu", marks=[pytest.mark.gpu, compiled_only])]


@pytest.mark.parametrize("device", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tool", ["modelopt", "compressed-tensors"])
def test_the_triton_kernel_is_the_reference_bit_for_bit(tool: str, dtype: torch.dtype, device: str) -> None:
    quant = M.MX_INPUTS[tool]
    x = _extremes(dtype)
    want = quant(x, use_triton=False)
    assert torch.equal(quant(x.to(device), use_triton=True).cpu(), want) and not want.isnan().any()
    assert torch.equal(quant(x.view(4, 10, 224).to(device), use_triton=True).cpu(), want.view(4, 10, 224))
    if device == "cuda":
        big = torch.randn(4096, 4096, generator=torch.Generator().manual_seed(1)).to(dtype)
        assert torch.equal(quant(big.cuda()).cpu(), quant(big, use_triton=False))


@pytest.mark.parametrize("use_triton", IMPLS)
def test_a_bad_input_is_named(use_triton: bool) -> None:
    with pytest.raises(ValueError, match="^x:"):
        M.modelopt_mxfp8_fake_quant(torch.zeros(2, 32, dtype=torch.int32), use_triton=use_triton)
