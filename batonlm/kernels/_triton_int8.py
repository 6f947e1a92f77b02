"""Triton kernels behind batonlm.kernels.int8 (imported on first use; see there for the meaning).

- `_quant_int8_kernel`: a program per row: its amax (read in chunks, so any K fits), its scale
  amax / 127.5 (correctly rounded: `div_rn`, as torch divides), each value divided by it,
  clamped to [-128, 127] and rounded half to even by adding and subtracting 1.5 * 2^23 (exact for
  |v| < 2^22: the sum's last bit is the units digit, rounded as IEEE rounds; `NO_FMA` and no
  fast-math keep the two operations), then stored as int8 (an integral value: exact).
- `_int8_matmul_kernel`: int8 tiles in `tl.dot` accumulating in int32 (an H100/H200 runs
  int8 tensor-core MMAs, exact), converted to float32 once at the end and multiplied by the
  token's scale and then the channel's (a stride of 0 broadcasts a per-tensor one), then the
  bias: the reference's order, so the two agree bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batonlm.kernels._triton_common import INTERPRET, NO_FMA, tile

_GPU_OPTS = {} if INTERPRET else {"num_warps": 4, "num_stages": 3}
_ROUNDER = tl.constexpr(12582912.0)  # 1.5 * 2^23: v + it - it is v rounded to an integer, half to even


@triton.jit
def _quant_int8_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, stride_s, half_range, min_scale,
                       STATIC: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    if STATIC:  # a stride of 0: one scale for every row
        scale = tl.load(s_ptr + row * stride_s).to(tl.float32)
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
        v = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -128.0), 127.0)
        v = (v + _ROUNDER) - _ROUNDER
        tl.store(q_ptr + row * stride_qm + offs, v.to(tl.int8), mask=offs < K)


def quant_int8(x: torch.Tensor, min_scale: float, half_range: float,
               static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q int8 [M, K], scale float32 [M, 1]), or with `static_scale` (one float32
    element, or one per row [M, 1]) q divided by it, and that scale."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.int8, device=x.device)
    scale = static_scale.contiguous() if static_scale is not None else torch.empty(
        (m, 1), dtype=torch.float32, device=x.device)
    if m and static_scale is None and not k:
        scale.fill_(min_scale)
    if m and k:
        cap = 8192 if INTERPRET else 1024
        block = tile(k, cap)
        stride_s = 1 if scale.numel() > 1 else 0  # static per row, or dynamic: row i's at i
        _quant_int8_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), stride_s, half_range, min_scale,
                                 STATIC=static_scale is not None, BLOCK=block, **NO_FMA)
    return q, scale


@triton.jit
def _int8_matmul_kernel(
    x_ptr, w_ptr, y_ptr, xs_ptr, ws_ptr, bias_ptr, M, N, K, stride_xm, stride_wn, stride_ym, stride_xs, stride_ws,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
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
    xs = tl.load(xs_ptr + offs_m * stride_xs, mask=m_valid, other=0.0)
    ws = tl.load(ws_ptr + offs_n * stride_ws, mask=n_valid, other=0.0)
    y = acc.to(tl.float32) * xs[:, None] * ws[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(out, y, mask=m_valid[:, None] & n_valid[None, :])  # converted to y's dtype by the store



def int8_matmul(x_q: torch.Tensor, w_q: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
                out_dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    """y [M, N] = (x_q [M, K] @ w_q [N, K]^T) * x_scale [M or 1, 1] * w_scale [N or 1, 1] + bias."""
    x_q = x_q if x_q.stride(-1) == 1 else x_q.contiguous()
    w_q = w_q if w_q.stride(-1) == 1 else w_q.contiguous()
    (m, k), n = x_q.shape, w_q.shape[0]
    # The interpreter's store truncates float32 to bfloat16 (triton 3.9): it stores float32 there,
    # converted with torch (round to nearest even, as a GPU's store does).
    y = torch.empty((m, n), dtype=torch.float32 if INTERPRET else out_dtype, device=x_q.device)
    if m == 0 or n == 0:
        return y.to(out_dtype)
    if k == 0:
        return (bias.float().expand(m, n) if bias is not None else torch.zeros_like(y)).to(out_dtype)
    block_m, block_n, block_k = tile(m, 64), tile(n, 128), max(32, tile(k, 128))
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int8_matmul_kernel[grid](
        x_q, w_q, y, x_scale, w_scale, bias.contiguous() if bias is not None else y, m, n, k,
        x_q.stride(0), w_q.stride(0), y.stride(0), int(x_scale.shape[0] > 1), int(w_scale.shape[0] > 1),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, **NO_FMA, **_GPU_OPTS,
    )
    return y.to(out_dtype)
