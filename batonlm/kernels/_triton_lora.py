"""Triton kernels behind batonlm.kernels.lora (imported on first use)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batonlm.kernels._triton_common import INTERPRET, NO_FMA, tile

BLOCK_M = 16


@triton.jit
def _segment_gemm_kernel(
    x_ptr, w_ptr, c_ptr, perm_ptr, seg_slot_ptr, seg_start_ptr,
    N, K, stride_xm, stride_ws, stride_wn, stride_wk, stride_cm,
    GATHER_X: tl.constexpr, SCATTER_ADD: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """c[row] (+)= x[row] @ w[slot].T for the rows of one block of one segment. Rows are
    positions in `perm`: x is read at the token (GATHER_X) or at the position, c written at the
    position or added at the token (SCATTER_ADD)."""
    s = tl.program_id(0)
    start = tl.load(seg_start_ptr + s)
    end = tl.load(seg_start_ptr + s + 1)
    slot = tl.load(seg_slot_ptr + s).to(tl.int64)
    pos = start + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = pos < end
    tok = tl.load(perm_ptr + pos, mask=valid, other=0).to(tl.int64)
    x_rows = tok if GATHER_X else pos.to(tl.int64)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < N
    w_base = w_ptr + slot * stride_ws
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_valid = offs_k < K
        xt = tl.load(x_ptr + x_rows[:, None] * stride_xm + offs_k[None, :],
                     mask=valid[:, None] & k_valid[None, :], other=0.0)
        wt = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk,
                     mask=n_valid[None, :] & k_valid[:, None], other=0.0)
        if IEEE:
            acc += tl.dot(xt, wt, input_precision="ieee")
        elif UPCAST:
            acc += tl.dot(xt.to(tl.float32), wt.to(tl.float32))
        else:
            acc += tl.dot(xt, wt)
    mask = valid[:, None] & n_valid[None, :]
    if SCATTER_ADD:  # each token is in one segment: no two programs add to one element
        c = c_ptr + tok[:, None] * stride_cm + offs_n[None, :]
        acc += tl.load(c, mask=mask, other=0.0).to(tl.float32)
    else:
        c = c_ptr + pos.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c, acc, mask=mask)  # converted to c's dtype by the store



def _launch(x, w, c, perm, seg_slot, seg_start, max_segment: int, gather: bool, scatter: bool) -> None:
    n, k = w.shape[1], w.shape[2]
    block_n, block_k = tile(n, 64), tile(k, 64)
    grid = (seg_slot.shape[0], triton.cdiv(max_segment, BLOCK_M), triton.cdiv(n, block_n))
    _segment_gemm_kernel[grid](
        x, w, c, perm, seg_slot, seg_start, n, k, x.stride(0), w.stride(0), w.stride(1), w.stride(2), c.stride(0),
        GATHER_X=gather, SCATTER_ADD=scatter, IEEE=x.dtype == torch.float32 and w.dtype == torch.float32,
        UPCAST=INTERPRET, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, **NO_FMA,
    )


def lora_delta(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, perm: torch.Tensor,
               seg_slot: torch.Tensor, seg_start: torch.Tensor, max_segment: int) -> torch.Tensor:
    if perm.numel() == 0 or max_segment == 0:
        return out
    x = x.contiguous()  # the weights are read through their strides (LoRAWeights.b is a view)
    assert out.stride(1) == 1
    shrunk = torch.empty((perm.shape[0], a.shape[1]), dtype=torch.float32, device=x.device)
    _launch(x, a, shrunk, perm, seg_slot, seg_start, max_segment, gather=True, scatter=False)
    _launch(shrunk, b, out, perm, seg_slot, seg_start, max_segment, gather=False, scatter=True)
    return out
