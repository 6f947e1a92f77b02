"""Triton kernel behind batonlm.kernels.llm_int8 (imported on first use; see there for the meaning).

`_llm_int8_matmul_kernel`: each K tile of the int8 weight read once for both products: the int8
activation codes against it in `tl.dot` accumulating in int32 (exact), and the activations of
the outlier columns (x times the column mask, the others exact zeros) against the same codes as
floats, accumulating in float32 (half-precision activations and codes below 2^8 multiply exactly
on the tensor cores; float32 activations in IEEE float32). At the end the integer sum is converted
to float32 once and multiplied by rs * scb, then by C1, the bias added, and the outlier sum times
scb times C2 added: the reference's order (its float32 sums in another order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batonlm.kernels._triton_common import INTERPRET, NO_FMA, tile
from batonlm.kernels.llm_int8 import INT_SCALE, OUTLIER_SCALE

_GPU_OPTS = {} if INTERPRET else {"num_warps": 4, "num_stages": 3}


@triton.jit
def _llm_int8_matmul_kernel(
    x_ptr, xq_ptr, rs_ptr, cols_ptr, w_ptr, scb_ptr, bias_ptr, y_ptr, M, N, K,
    stride_xm, stride_xqm, stride_wn, stride_ym, int_scale, outlier_scale,
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_valid, n_valid = offs_m < M, offs_n < N
    rows = offs_m.to(tl.int64)[:, None]
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn
    acc_int = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    acc_out = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_valid = offs_k < K
        mk = m_valid[:, None] & k_valid[None, :]
        w = tl.load(w_cols + offs_k[:, None], mask=n_valid[None, :] & k_valid[:, None], other=0)  # [BK, BN] int8
        acc_int += tl.dot(tl.load(xq_ptr + rows * stride_xqm + offs_k[None, :], mask=mk, other=0), w)
        x = tl.load(x_ptr + rows * stride_xm + offs_k[None, :], mask=mk, other=0.0)
        cols = tl.load(cols_ptr + offs_k, mask=k_valid, other=0.0)
        outl = x.to(tl.float32) * cols[None, :]  # the outlier columns (exact: a product by 1 or 0)
        if IEEE:
            acc_out += tl.dot(outl, w.to(tl.float32), input_precision="ieee")
        else:  # half precision: x's values and the codes exactly, products exact in float32
            acc_out += tl.dot(outl.to(x.dtype), w.to(x.dtype))
    rs = tl.load(rs_ptr + offs_m, mask=m_valid, other=0.0)
    scb = tl.load(scb_ptr + offs_n, mask=n_valid, other=0.0)
    y = acc_int.to(tl.float32) * (rs[:, None] * scb[None, :]) * int_scale
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
    y += acc_out * scb[None, :] * outlier_scale
    tl.store(y_ptr + rows * stride_ym + offs_n[None, :], y, mask=m_valid[:, None] & n_valid[None, :])


def llm_int8_matmul(x: torch.Tensor, x_q: torch.Tensor, rs: torch.Tensor, cols: torch.Tensor, w_q: torch.Tensor,
                    scb: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    x = x if x.stride(-1) == 1 else x.contiguous()
    x_q = x_q if x_q.stride(-1) == 1 else x_q.contiguous()
    w_q = w_q if w_q.stride(-1) == 1 else w_q.contiguous()
    (m, k), n = x.shape, w_q.shape[0]
    # Under the interpreter y is float32, converted by torch (its store truncates to half types).
    y = torch.empty((m, n), dtype=torch.float32 if INTERPRET else x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y.to(x.dtype)
    block_m, block_n = tile(m, 64), tile(n, 128)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _llm_int8_matmul_kernel[grid](
        x, x_q, rs.contiguous(), cols.contiguous(), w_q, scb.contiguous(), bias.contiguous() if bias is not None else y,
        y, m, n, k, x.stride(0), x_q.stride(0), w_q.stride(0), y.stride(0), INT_SCALE, OUTLIER_SCALE,
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32 or INTERPRET, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=64, **NO_FMA, **_GPU_OPTS,
    )
    return y.to(x.dtype)
