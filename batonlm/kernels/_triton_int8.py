"""Triton kernels behind batonlm.kernels.int8 (imported on first use; see there for the meaning).

- `_quant_int8_kernel`: a program per row: its amax (read in chunks, so any K fits), its scale
  amax / 127.5 (correctly rounded: `div_rn`, as torch divides), each value divided by it,
  clamped to [-128, 127] and rounded half to even by adding and subtracting 1.5 * 2^23 (exact for
  |v| < 2^22: the sum's last bit is the units digit, rounded as IEEE rounds; `NO_FMA` and no
  fast-math keep the two operations), then stored as int8 (an integral value: exact).
- `_int8_matmul_kernel`: int8 tiles in `tl.dot` accumulating in int32 (an H100/H200 runs
  int8 tensor-core MMAs, exact), converted to float32 once at the end and multiplied by the
  token's scale and then the channel's (a stride of 0 broadcasts a per-tensor one), then the
  bias: the reference's order, so the two agree bit for bit. `HAS_ZERO`: the token's zero point
  times the weight row's sum taken off the int32 sum first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batonlm.kernels._triton_common import INTERPRET, NO_FMA, tile

_GPU_OPTS = {} if INTERPRET else {"num_warps": 4, "num_stages": 3}
_ROUNDER = tl.constexpr(12582912.0)  # 1.5 * 2^23: v + it - it is v rounded to an integer, half to even


@triton.jit
def _quant_int8_kernel(x_ptr, q_ptr, s_ptr, z_ptr, K, stride_xm, stride_qm, stride_s, half_range, min_scale,
                       STATIC: tl.constexpr, ASYM: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    zero = 0.0
    if STATIC:  # a stride of 0: one scale (and zero) for every row
        scale = tl.load(s_ptr + row * stride_s).to(tl.float32)
        if ASYM:
            zero = tl.load(z_ptr + row * stride_s).to(tl.float32)
    elif ASYM:  # half_range: the whole range 255; min_scale: the scale of a range of 0
        lo = tl.zeros([BLOCK], dtype=tl.float32)  # from 0: the range includes 0 (and masked lanes)
        hi = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            lo = tl.minimum(lo, x)
            hi = tl.maximum(hi, x)
        lo_row = tl.min(lo, axis=0)
        scale = tl.math.div_rn(tl.max(hi, axis=0) - lo_row, half_range)
        scale = tl.where(scale == 0.0, min_scale, scale)
        zero = tl.minimum(tl.maximum(-128.0 - tl.math.div_rn(lo_row, scale), -128.0), 127.0)
        zero = (zero + _ROUNDER) - _ROUNDER
        tl.store(s_ptr + row, scale)
        tl.store(z_ptr + row, zero.to(tl.int32))
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), half_range), min_scale)
        tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        v = tl.math.div_rn(x, scale)
        if ASYM:
            v = v + zero
        v = tl.minimum(tl.maximum(v, -128.0), 127.0)
        v = (v + _ROUNDER) - _ROUNDER
        tl.store(q_ptr + row * stride_qm + offs, v.to(tl.int8), mask=offs < K)


def quant_int8(x: torch.Tensor, min_scale: float, half_range: float, static_scale: torch.Tensor | None = None,
               static_zero: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q int8 [M, K], scale float32 [M, 1]), or with `static_scale` (one float32
    element, or one per row [M, 1]; and an int32 `static_zero` of its shape) q divided by it,
    and that scale."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.int8, device=x.device)
    scale = static_scale.contiguous() if static_scale is not None else torch.empty(
        (m, 1), dtype=torch.float32, device=x.device)
    if m and static_scale is None and not k:
        scale.fill_(min_scale)
    zero = static_zero.contiguous() if static_zero is not None else scale
    _launch(x, q, scale, zero, half_range, min_scale, static=static_scale is not None, asym=static_zero is not None)
    return q, scale


def quant_int8_asym(x: torch.Tensor, full_range: float, zero_range_scale: float,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q int8 [M, K], scale float32 [M, 1], zero int32 [M, 1]), per token."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.int8, device=x.device)
    scale = torch.full((m, 1), zero_range_scale, dtype=torch.float32, device=x.device)
    zero = torch.full((m, 1), -128, dtype=torch.int32, device=x.device)  # K = 0: the range [0, 0]
    _launch(x, q, scale, zero, full_range, zero_range_scale, static=False, asym=True)
    return q, scale, zero


def _launch(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, divisor: float,
            least: float, static: bool, asym: bool) -> None:
    m, k = x.shape
    if m and k:
        cap = 8192 if INTERPRET else 1024
        block = tile(k, cap)
        stride_s = 1 if scale.numel() > 1 else 0  # static per row, or dynamic: row i's at i
        _quant_int8_kernel[(m,)](x, q, scale, zero, k, x.stride(0), q.stride(0), stride_s, divisor, least,
                                 STATIC=static, ASYM=asym, BLOCK=block, **NO_FMA)


@triton.jit
def _int8_matmul_kernel(
    x_ptr, w_ptr, y_ptr, xs_ptr, ws_ptr, bias_ptr, xz_ptr, wsum_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
    stride_xs, stride_ws, HAS_BIAS: tl.constexpr, HAS_ZERO: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_valid, n_valid = offs_m < M, offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_valid = offs_k < K
        a = tl.load(x_rows + offs_k[None, :], mask=m_valid[:, None] & k_valid[None, :], other=0)
        b = tl.load(w_cols + offs_k[:, None], mask=n_valid[None, :] & k_valid[:, None], other=0)
        acc += tl.dot(a, b)
    if HAS_ZERO:  # sum_k (x - zero) w = sum_k x w - zero * sum_k w, in int32
        xz = tl.load(xz_ptr + offs_m * stride_xs, mask=m_valid, other=0)
        wsum = tl.load(wsum_ptr + offs_n, mask=n_valid, other=0)
        acc -= xz[:, None] * wsum[None, :]
    xs = tl.load(xs_ptr + offs_m * stride_xs, mask=m_valid, other=0.0)
    ws = tl.load(ws_ptr + offs_n * stride_ws, mask=n_valid, other=0.0)
    y = acc.to(tl.float32) * xs[:, None] * ws[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(out, y, mask=m_valid[:, None] & n_valid[None, :])  # converted to y's dtype by the store



def int8_matmul(x_q: torch.Tensor, w_q: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
                out_dtype: torch.dtype, bias: torch.Tensor | None,
                zero: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """y [M, N] = ((x_q [M, K] - x_zero) @ w_q [N, K]^T) * x_scale [M or 1, 1] * w_scale [N or 1, 1]
    + bias; `zero`: (x_zero int32 [M or 1, 1], w_sum int32 [N]) or None."""
    x_q = x_q if x_q.stride(-1) == 1 else x_q.contiguous()
    w_q = w_q if w_q.stride(-1) == 1 else w_q.contiguous()
    (m, k), n = x_q.shape, w_q.shape[0]
    # The interpreter's store truncates float32 to bfloat16 (triton 3.9): it stores float32 there,
    # converted with torch (round to nearest even, as a GPU's store does).
    y = torch.empty((m, n), dtype=torch.float32 if INTERPRET else out_dtype, device=x_q.device)
    if m == 0 or n == 0:
        return y.to(out_dtype)
    if k == 0:  # an empty sum (a zero point times an empty row sum, too)
        return (bias.float().expand(m, n) if bias is not None else torch.zeros_like(y)).to(out_dtype)
    block_m, block_n, block_k = tile(m, 64), tile(n, 128), max(32, tile(k, 128))
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int8_matmul_kernel[grid](
        x_q, w_q, y, x_scale, w_scale, bias.contiguous() if bias is not None else y,
        *(zero if zero is not None else (x_scale, w_scale)), m, n, k,
        x_q.stride(0), w_q.stride(0), y.stride(0), int(x_scale.shape[0] > 1), int(w_scale.shape[0] > 1),
        HAS_BIAS=bias is not None, HAS_ZERO=zero is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, **NO_FMA, **_GPU_OPTS,
    )
    return y.to(out_dtype)
