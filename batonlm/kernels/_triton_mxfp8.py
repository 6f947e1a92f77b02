"""Triton kernel behind batonlm.kernels.mxfp8 (imported on first use; see there for the format).

`_mx_quant_kernel`: a program per row and tile of groups of 32 inputs: each group's amax, its
exponent e by the tool's rule (ModelOpt's or compressed-tensors', `RULE`) read off the float
bits (exact, no log), the values times 2^-e (exact), clamped to +-448 and rounded to e4m3 by
arithmetic (the step 2^(floor(log2 |v|) - 3), 2^-9 below e4m3's least normal 2^-6, each value
v / step (a product by a power of two: exact) rounded half to even by adding and subtracting 1.5 * 2^23, exact below 2^22), then times
2^e: one pass of the input for the whole fake quantization (the torch reference takes ~10). No
float8 conversion, so the interpreter (whose float32 -> float8 conversion mis-rounds,
_triton_quant.py) computes what a GPU does; it is given float32 inputs and gives float32 values,
torch converting them (its conversions between float32 and bfloat16 / float16 mis-round
subnormals too: a bfloat16 1.01e-39 read as 0.75 * 2^-127).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batonlm.kernels._triton_common import INTERPRET, NO_FMA, device_fn

_ROUNDER = tl.constexpr(12582912.0)  # 1.5 * 2^23: v + it - it is v rounded to an integer, half to even
GROUPS_PER_PROGRAM = 8


@device_fn
def _pow2(k):
    """2^k as float32 for integer k in [-149, 127], exact (subnormal below -126)."""
    normal = ((k + 127).to(tl.int32) << 23).to(tl.float32, bitcast=True)
    tiny = (tl.full(k.shape, 1, tl.int32) << tl.minimum(tl.maximum(k + 149, 0), 22)).to(tl.float32, bitcast=True)
    return tl.where(k >= -126, normal, tiny)


@device_fn
def _exponent(a, RULE: tl.constexpr):
    """The group's exponent e from its amax `a` (float32 >= 0): RULE 0, ModelOpt's ceil(log2(a /
    448)) in [-127, 127] (a = 0: -127); RULE 1, compressed-tensors' floor(log2 a) - 8, one more
    where a's mantissa is >= 1.75, in [-127, 128] (a = 0 or subnormal: -127)."""
    if RULE == 0:
        d = tl.math.div_rn(a, tl.full(a.shape, 448.0, tl.float32))
        bits = d.to(tl.int32, bitcast=True)
        field, mant = (bits >> 23) & 0xFF, bits & 0x7FFFFF
        e = tl.where(field > 0, field - 127 + (mant != 0).to(tl.int32),  # ceil(log2 d) of a normal d
                     tl.where(mant > (1 << 22), -126, -127))  # a subnormal d: in (2^-127, 2^-126) or below
        return tl.minimum(tl.maximum(e, -127), 127)
    bits = a.to(tl.int32, bitcast=True)
    field, mant = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    p = field - 127 + (mant >= (3 << 21)).to(tl.int32)
    return tl.where(field > 0, tl.minimum(tl.maximum(p - 8, -127), 128), -127)


@triton.jit
def _mx_quant_kernel(x_ptr, y_ptr, K, stride_xm, stride_ym, RULE: tl.constexpr, GROUPS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * GROUPS * 32 + tl.arange(0, GROUPS)[:, None] * 32 + tl.arange(0, 32)[None, :]
    valid = cols < K
    x = tl.load(x_ptr + row * stride_xm + cols, mask=valid, other=0.0).to(tl.float32)
    e = _exponent(tl.max(tl.abs(x), axis=1), RULE)[:, None]  # [GROUPS, 1]
    v = x * _pow2(-e)
    v = tl.minimum(tl.maximum(v, -448.0), 448.0)
    a = tl.abs(v)
    log2 = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    spacing = tl.maximum(log2, -6) - 3  # e4m3's spacing at |v| is 2^spacing (its subnormals' 2^-9 below 2^-6)
    q = ((a * _pow2(-spacing) + _ROUNDER) - _ROUNDER) * _pow2(spacing)
    q = tl.where(v < 0, -q, q)
    y = q * _pow2(e)
    tl.store(y_ptr + row * stride_ym + cols, y.to(y_ptr.dtype.element_ty), mask=valid)


def mx_quant(x: torch.Tensor, rule: int) -> torch.Tensor:
    """x [M, K] -> its MXFP8 values [M, K] in x's dtype (rule 0 ModelOpt's exponent, 1 compressed-tensors')."""
    dtype = x.dtype
    if INTERPRET:  # (its bfloat16 / float16 <-> float32 conversions of subnormals are wrong: torch's convert)
        x = x.float()
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x.shape
    y = torch.empty(m, k, dtype=x.dtype, device=x.device)
    if m and k:
        grid = (m, triton.cdiv(k, 32 * GROUPS_PER_PROGRAM))
        _mx_quant_kernel[grid](x, y, k, x.stride(0), y.stride(0), RULE=rule, GROUPS=GROUPS_PER_PROGRAM,
                               **({} if INTERPRET else {"num_warps": 2}), **NO_FMA)
    return y.to(dtype)
