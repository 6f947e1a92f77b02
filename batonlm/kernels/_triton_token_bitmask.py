"""Triton kernel behind batonlm.kernels.token_bitmask (imported on first use)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _bitmask_kernel(logits_ptr, logits_stride, bitmask_ptr, bitmask_stride, rows_ptr, V, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < V
    words = tl.load(bitmask_ptr + r.to(tl.int64) * bitmask_stride + offs // 32, mask=valid, other=0)
    allowed = ((words >> (offs % 32)) & 1) != 0
    row = tl.load(rows_ptr + r).to(tl.int64)
    ptr = logits_ptr + row * logits_stride + offs
    x = tl.load(ptr, mask=valid, other=0.0)
    tl.store(ptr, tl.where(allowed, x, float("-inf")), mask=valid)


def apply(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    if rows.numel() == 0:
        return
    assert logits.stride(1) == 1 and bitmask.dtype == torch.int32
    bitmask = bitmask.contiguous()
    rows = rows.to(torch.int64).contiguous()
    vocab = logits.shape[1]
    grid = (rows.shape[0], triton.cdiv(vocab, BLOCK))
    _bitmask_kernel[grid](logits, logits.stride(0), bitmask, bitmask.stride(0), rows, vocab, BLOCK=BLOCK)
