"""Triton kernel behind batonlm.kernels.moe (imported on first use).

One grouped GEMM: row block b of `sorted_ids` holds pairs routed to expert `block_expert[b]`;
its program multiplies their input rows by that expert's weight and writes each product row at
the pair's own index (so no scatter follows). Blocks past the last group return at once. Float32
inputs are multiplied in IEEE float32 (no TF32), half inputs accumulate in float32 (the
interpreter multiplies half tiles wrongly, so there they are converted to float32 first: the
same exact products).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batonlm.kernels._triton_common import INTERPRET, NO_FMA

BLOCK_M = 16


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, w_ptr, c_ptr, sorted_ids_ptr, block_expert_ptr,
    rows, N, K, a_row_div, num_experts,
    stride_am, stride_we, stride_wn, stride_wk, stride_cm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= num_experts:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(sorted_ids_ptr + offs_m)
    valid = ids < rows
    a_rows = (ids // a_row_div).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < N
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_valid = offs_k < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + offs_k[None, :],
                    mask=valid[:, None] & k_valid[None, :], other=0.0)
        w = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk,
                    mask=n_valid[None, :] & k_valid[:, None], other=0.0)
        if IEEE:
            acc += tl.dot(a, w, input_precision="ieee")
        elif UPCAST:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32))
        else:
            acc += tl.dot(a, w)
    c = c_ptr + ids.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c, acc, mask=valid[:, None] & n_valid[None, :])  # converted to c's dtype by the store


def _block(n: int, cap: int) -> int:
    return max(16, min(cap, triton.next_power_of_2(n)))


def grouped_gemm(
    a: torch.Tensor, w: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor, rows: int, a_row_div: int,
) -> torch.Tensor:
    """c [rows, N]: c[i] = a[i // a_row_div] @ w[expert of pair i]^T for each pair i in
    `sorted_ids` (a [*, K], w [E, N, K])."""
    a = a.contiguous()
    n, k = w.shape[1], w.shape[2]
    c = torch.empty((rows, n), dtype=a.dtype, device=a.device)
    if rows == 0:
        return c
    block_n, block_k = _block(n, 64), _block(k, 64)
    grid = (block_expert.shape[0], triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, w, c, sorted_ids, block_expert,
        rows, n, k, a_row_div, w.shape[0],
        a.stride(0), w.stride(0), w.stride(1), w.stride(2), c.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=a.dtype == torch.float32,
        UPCAST=INTERPRET, **NO_FMA,
    )
    return c
