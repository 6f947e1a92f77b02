"""Triton kernel behind batonlm.kernels.moe_int4 (imported on first use).

`_triton_moe.py`'s grouped GEMM with int4 experts: row block b of `sorted_ids` holds pairs routed
to expert `block_expert[b]`; its program unpacks each K tile of that expert's `qweight` (8
nibbles per int32), dequantizes it ((q - zero) * scale in float32, exact, or codebook[q] * scale;
each row's group by row // group, or in activation order the expert's `g_idx`), rounds it once to the
activation dtype and multiplies it in `tl.dot` with float32 accumulation (float32 activations in
IEEE float32), as `_triton_quant.py`'s int4 kernel does for one weight; each product row is
written at its pair's index. Under the interpreter tiles are multiplied in float32 (exact for the
rounded values) and the result is stored in float32, converted by torch (its store truncates to
half types).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batonlm.kernels._triton_common import INTERPRET, NO_FMA, tile
from batonlm.kernels._triton_moe import BLOCK_M, pair_rows
from batonlm.kernels._triton_quant import int4_tile
from batonlm.kernels.moe_int4 import Int4Weights


@triton.jit
def _grouped_gemm_int4_kernel(
    a_ptr, qw_ptr, s_ptr, z_ptr, gidx_ptr, cb_ptr, s2_ptr, c_ptr, sorted_ids_ptr, block_expert_ptr,
    rows, N, K, group, a_row_div, num_experts,
    stride_am, stride_qe, stride_qk, stride_se, stride_sg, stride_ze, stride_zg, stride_ge, stride_s2e, stride_cm,
    G_IDX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
    IEEE: tl.constexpr, BITS: tl.constexpr, CODEBOOK: tl.constexpr, SCALE_2: tl.constexpr, E8M0: tl.constexpr,
):
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= num_experts:
        return
    ids, valid, a_rows, offs_n, n_valid = pair_rows(sorted_ids_ptr, pid_m, rows, a_row_div, N, BLOCK_M, BLOCK_N)
    e = expert.to(tl.int64)
    qw, s, z = qw_ptr + e * stride_qe, s_ptr + e * stride_se, z_ptr + e * stride_ze
    gidx = gidx_ptr + e * stride_ge  # (activation order: the expert's own row groups)
    s2 = s2_ptr + e * stride_s2e  # (NVFP4: the expert's per-tensor scale, per column)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_valid = offs_k < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + offs_k[None, :],
                    mask=valid[:, None] & k_valid[None, :], other=0.0)
        w = int4_tile(qw, s, z, gidx, cb_ptr, s2, offs_k, offs_n, k_valid, n_valid, k0, group, stride_qk, stride_sg,
                      stride_zg, False, G_IDX, BITS, CODEBOOK, SCALE_2, E8M0).to(a.dtype)  # float32, rounded once
        if UPCAST or IEEE:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    c = c_ptr + ids.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c, acc, mask=valid[:, None] & n_valid[None, :])



def grouped_gemm_int4(a: torch.Tensor, w: Int4Weights, group: int, sorted_ids: torch.Tensor,
                      block_expert: torch.Tensor, rows: int, a_row_div: int) -> torch.Tensor:
    """c [rows, N] in a's dtype: c[i] = a[i // a_row_div] @ W[expert of pair i]^T, W from the
    expert's int4 weights (`moe_int4.py`'s layout)."""
    a = a.contiguous()
    qweight, scales = w.qweight.contiguous(), w.scales.contiguous()
    zeros = w.zeros.contiguous() if w.zeros is not None else scales  # (unread with a codebook)
    codebook = w.codebook.contiguous() if w.codebook is not None else scales
    g_idx = w.g_idx.to(torch.int32).contiguous() if w.g_idx is not None else None
    scale_2 = w.scale_2.contiguous() if w.scale_2 is not None else None
    n, k = qweight.shape[2], w.k
    c = torch.empty((rows, n), dtype=torch.float32 if INTERPRET else a.dtype, device=a.device)
    if rows == 0:
        return c.to(a.dtype)
    block_n = tile(n, 64)
    grid = (block_expert.shape[0], triton.cdiv(n, block_n))
    _grouped_gemm_int4_kernel[grid](
        a, qweight, scales, zeros, g_idx if g_idx is not None else qweight, codebook,
        scale_2 if scale_2 is not None else codebook, c, sorted_ids, block_expert,
        rows, n, k, k if group == -1 else max(group, 1), a_row_div, qweight.shape[0],
        a.stride(0), qweight.stride(0), qweight.stride(1), scales.stride(0), scales.stride(1),
        zeros.stride(0), zeros.stride(1), g_idx.stride(0) if g_idx is not None else 0,
        scale_2.stride(0) if scale_2 is not None else 0, c.stride(0),
        G_IDX=g_idx is not None, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=64, UPCAST=INTERPRET,
        IEEE=a.dtype == torch.float32, BITS=w.bits, CODEBOOK=w.codebook is not None,
        SCALE_2=0 if scale_2 is None else 2 if w.scale_2_divides else 1, E8M0=scales.dtype == torch.uint8,
        **NO_FMA,
    )
    return c.to(a.dtype)
