"""Triton kernels behind batonlm.kernels.moe, moe_fp8 and moe_int8 (imported on first use).

One grouped GEMM: row block b of `sorted_ids` holds pairs routed to expert `block_expert[b]`;
its program multiplies their input rows by that expert's weight and writes each product row at
the pair's own index (so no scatter follows). Blocks past the last group return at once. Float32
inputs are multiplied in IEEE float32 (no TF32), half inputs accumulate in float32 (the
interpreter multiplies half tiles wrongly, so there they are converted to float32 first: the
same exact products).

`grouped_gemm_fp8` is the same GEMM over FP8 tiles (moe_fp8.py): the K tile divides the scale
block, so each tile's partial product is multiplied by its rows' activation scales and the
expert's weight scales of its columns before it is added (DeepSeek-V3's block-wise scheme); per
channel, the whole sum is multiplied by the row's and the column's scale once.
`grouped_gemm_int8` is the same over int8 tiles (moe_int8.py: W8A8 int8), summed exactly in int32
and scaled once at the end, in int8.py's order (so a row's product is `int8_scaled_matmul`'s).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batonlm.kernels._triton_common import INTERPRET, NO_FMA, device_fn, tile

BLOCK_M = 16


@device_fn
def pair_rows(sorted_ids_ptr, pid_m, rows, a_row_div, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A grouped GEMM program's pairs and columns: its row block's pair indices (`sorted_ids`),
    which are real (not padding), their input rows (pair // a_row_div), its output columns and
    which are inside N."""
    ids = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return ids, ids < rows, (ids // a_row_div).to(tl.int64), offs_n, offs_n < N


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
    ids, valid, a_rows, offs_n, n_valid = pair_rows(sorted_ids_ptr, pid_m, rows, a_row_div, N, BLOCK_M, BLOCK_N)
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
    block_n, block_k = tile(n, 64), tile(k, 64)
    grid = (block_expert.shape[0], triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, w, c, sorted_ids, block_expert,
        rows, n, k, a_row_div, w.shape[0],
        a.stride(0), w.stride(0), w.stride(1), w.stride(2), c.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=a.dtype == torch.float32,
        UPCAST=INTERPRET, **NO_FMA,
    )
    return c


@triton.jit
def _grouped_gemm_fp8_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, c_ptr, sorted_ids_ptr, block_expert_ptr,
    rows, N, K, a_row_div, num_experts, block_n, block_k,
    stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_cm,
    K_BLOCKED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= num_experts:
        return
    ids, valid, a_rows, offs_n, n_valid = pair_rows(sorted_ids_ptr, pid_m, rows, a_row_div, N, BLOCK_M, BLOCK_N)
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    ws_base = ws_ptr + expert.to(tl.int64) * stride_wse
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_valid = offs_k < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + offs_k[None, :],
                    mask=valid[:, None] & k_valid[None, :], other=0.0)
        w = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None],
                    mask=n_valid[None, :] & k_valid[:, None], other=0.0)
        if UPCAST:
            d = tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:  # Hopper's FP8 MMA adds in ~14 bits: promote to float32 at least every tile
            d = tl.dot(a, w, max_num_imprecise_acc=BLOCK_K)
        if K_BLOCKED:
            kb = k0 // block_k  # the K tile divides the scale block: one scale column per tile
            a_s = tl.load(as_ptr + a_rows * stride_asm + kb, mask=valid, other=0.0)
            w_s = tl.load(ws_base + (offs_n // block_n) * stride_wsn + kb, mask=n_valid, other=0.0)
            acc += d * (a_s[:, None] * w_s[None, :])
        else:
            acc += d
    if not K_BLOCKED:  # per token and per channel: both scales once, as fp8_scaled_matmul does
        a_s = tl.load(as_ptr + a_rows * stride_asm, mask=valid, other=0.0)
        w_s = tl.load(ws_base + offs_n * stride_wsn, mask=n_valid, other=0.0)
        acc = acc * (a_s[:, None] * w_s[None, :])
    c = c_ptr + ids.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c, acc, mask=valid[:, None] & n_valid[None, :])


def grouped_gemm_fp8(
    a_q: torch.Tensor, a_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int] | None,
    sorted_ids: torch.Tensor, block_expert: torch.Tensor, rows: int, a_row_div: int, out_dtype: torch.dtype,
) -> torch.Tensor:
    """c [rows, N] in `out_dtype`: c[i] = a[i // a_row_div] @ w[expert of pair i]^T with FP8 a_q
    [*, K] (scale [*, ceil(K / bk)] per row and group) and w_q [E, N, K] (scale [E, ceil(N /
    bn), ceil(K / bk)]); `block` None: a_scale [*, 1] per row, w_scale [E, N] per channel."""
    a_q, a_scale, w_q, w_scale = a_q.contiguous(), a_scale.contiguous(), w_q.contiguous(), w_scale.contiguous()
    n, k = w_q.shape[1], w_q.shape[2]
    bn, bk = block or (1, max(16, triton.next_power_of_2(k)))
    # The interpreter's store truncates float32 to half types: it stores float32 there, converted by torch.
    c = torch.empty((rows, n), dtype=torch.float32 if INTERPRET else out_dtype, device=a_q.device)
    if rows == 0:
        return c.to(out_dtype)
    tile_k = min(128, bk & -bk)  # the largest power of two dividing the scale block (per channel: any)
    if tile_k < 16:
        raise ValueError(f"block: the Triton kernel needs a K block that is a multiple of 16, got {bk}")
    block_n = tile(n, 64)
    grid = (block_expert.shape[0], triton.cdiv(n, block_n))
    _grouped_gemm_fp8_kernel[grid](
        a_q, a_scale, w_q, w_scale, c, sorted_ids, block_expert,
        rows, n, k, a_row_div, w_q.shape[0], bn, bk,
        a_q.stride(0), a_scale.stride(0), w_q.stride(0), w_q.stride(1), w_scale.stride(0), w_scale.stride(1),
        c.stride(0), K_BLOCKED=block is not None, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=tile_k,
        UPCAST=INTERPRET, **NO_FMA,
    )
    return c.to(out_dtype)


@triton.jit
def _grouped_gemm_int8_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, c_ptr, sorted_ids_ptr, block_expert_ptr,
    rows, N, K, a_row_div, num_experts,
    stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_cm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= num_experts:
        return
    ids, valid, a_rows, offs_n, n_valid = pair_rows(sorted_ids_ptr, pid_m, rows, a_row_div, N, BLOCK_M, BLOCK_N)
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_valid = offs_k < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + offs_k[None, :],
                    mask=valid[:, None] & k_valid[None, :], other=0)
        w = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None],
                    mask=n_valid[None, :] & k_valid[:, None], other=0)
        acc += tl.dot(a, w)  # int8 x int8 summed exactly in int32
    a_s = tl.load(as_ptr + a_rows * stride_asm, mask=valid, other=0.0)
    w_s = tl.load(ws_ptr + expert.to(tl.int64) * stride_wse + offs_n, mask=n_valid, other=0.0)
    y = acc.to(tl.float32) * a_s[:, None] * w_s[None, :]  # int8.py's order: the sum, the token's, the channel's
    c = c_ptr + ids.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c, y, mask=valid[:, None] & n_valid[None, :])


def grouped_gemm_int8(
    a_q: torch.Tensor, a_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
    sorted_ids: torch.Tensor, block_expert: torch.Tensor, rows: int, a_row_div: int, out_dtype: torch.dtype,
) -> torch.Tensor:
    """c [rows, N] in `out_dtype`: (a_q[i // a_row_div] @ w_q[expert of pair i]^T) * a_scale[row]
    * w_scale[expert, n], int8 a_q [*, K] with a_scale [*, 1] and w_q [E, N, K] with w_scale [E, N]."""
    a_q, a_scale, w_q, w_scale = a_q.contiguous(), a_scale.contiguous(), w_q.contiguous(), w_scale.contiguous()
    n, k = w_q.shape[1], w_q.shape[2]
    c = torch.empty((rows, n), dtype=torch.float32 if INTERPRET else out_dtype, device=a_q.device)
    if rows == 0:
        return c.to(out_dtype)
    block_n, block_k = tile(n, 64), max(32, tile(k, 64))
    grid = (block_expert.shape[0], triton.cdiv(n, block_n))
    _grouped_gemm_int8_kernel[grid](
        a_q, a_scale, w_q, w_scale, c, sorted_ids, block_expert, rows, n, k, a_row_div, w_q.shape[0],
        a_q.stride(0), a_scale.stride(0), w_q.stride(0), w_q.stride(1), w_scale.stride(0), c.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, **NO_FMA,
    )
    return c.to(out_dtype)
