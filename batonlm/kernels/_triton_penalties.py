"""Triton kernel behind batonlm.kernels.penalties (imported on first use).

A program per (row, vocabulary block) reads each logit, count and prompt flag once. The logit
bias and banned ids are short per-row lists: a block compares itself with a chunk of a list only
when some id of the chunk falls inside the block, so most blocks pay one small load per chunk.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batonlm.kernels._triton_common import INTERPRET, NO_FMA, device_fn, rows_f32, vec

LIST_CHUNK = 4  # ids of a bias / banned list compared with a block at once ([block, 4] tile)
# NO_FMA matters here: freq * count + pres must round twice, as torch's does, for bit-equal results.
OPTIONS = dict(num_warps=8, **NO_FMA)


@device_fn
def _list_hits(offs, start, ids_ptr, n, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """Which tokens of the block offs (= start + arange(BLOCK)) the list of n ids at ids_ptr
    (-1 = padding) names."""
    hit = offs < 0
    for j in range(0, n, CHUNK):
        jo = j + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + jo, mask=jo < n, other=-1)
        inside = (ids >= start) & (ids < start + BLOCK)
        if tl.sum(inside.to(tl.int32), axis=0) > 0:
            match = offs[:, None].to(tl.int64) == ids[None, :]
            hit = hit | (tl.sum(match.to(tl.int32), axis=1) > 0)
    return hit


@device_fn
def _list_sums(offs, start, ids_ptr, values_ptr, n, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """_list_hits, and for each token the sum of the values (values_ptr) listed for it."""
    hit = offs < 0
    total = tl.zeros([BLOCK], tl.float32)
    for j in range(0, n, CHUNK):
        jo = j + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + jo, mask=jo < n, other=-1)
        inside = (ids >= start) & (ids < start + BLOCK)
        if tl.sum(inside.to(tl.int32), axis=0) > 0:
            values = tl.load(values_ptr + jo, mask=jo < n, other=0.0)
            match = offs[:, None].to(tl.int64) == ids[None, :]
            hit = hit | (tl.sum(match.to(tl.int32), axis=1) > 0)
            total += tl.sum(tl.where(match, values[None, :], 0.0), axis=1)
    return hit, total


@triton.jit
def _penalties_kernel(logits_ptr, out_ptr, stride, out_stride, slots_ptr, counts_ptr, counts_stride, prompt_ptr,
                      prompt_stride, freq_ptr, pres_ptr, rep_ptr, bias_ids_ptr, bias_values_ptr, n_bias,
                      banned_ptr, n_banned, V, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    row = tl.program_id(0)
    start = tl.program_id(1) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    valid = offs < V
    x = tl.load(logits_ptr + row.to(tl.int64) * stride + offs, mask=valid, other=0.0)
    slot = tl.load(slots_ptr + row)
    count = tl.load(counts_ptr + slot * counts_stride + offs, mask=valid, other=0)
    in_prompt = tl.load(prompt_ptr + slot * prompt_stride + offs, mask=valid, other=0) != 0

    # (a) logit bias
    biased, bias = _list_sums(offs, start, bias_ids_ptr + row.to(tl.int64) * n_bias,
                              bias_values_ptr + row.to(tl.int64) * n_bias, n_bias, BLOCK, CHUNK)
    x = tl.where(biased, x + bias, x)
    # (b) repetition penalty on tokens of the prompt or the output
    rep = tl.load(rep_ptr + row)
    x = tl.where(in_prompt | (count > 0), tl.where(x > 0.0, tl.math.div_rn(x, rep), x * rep), x)
    # (c) frequency and presence penalties on output tokens
    freq = tl.load(freq_ptr + row)
    pres = tl.load(pres_ptr + row)
    x = x - (freq * count.to(tl.float32) + pres * (count > 0).to(tl.float32))
    # (d) banned ids
    banned = _list_hits(offs, start, banned_ptr + row.to(tl.int64) * n_banned, n_banned, BLOCK,
                        CHUNK)
    x = tl.where(banned, float("-inf"), x)
    tl.store(out_ptr + row.to(tl.int64) * out_stride + offs, x, mask=valid)


def _ids(ids: torch.Tensor, b: int) -> torch.Tensor:
    if ids.dim() != 2 or ids.shape[0] != b:
        raise ValueError(f"expected a [{b}, N] id list, got shape {tuple(ids.shape)}")
    return vec(ids, torch.int64)


def apply(
    logits: torch.Tensor, req_slots: torch.Tensor, output_counts: torch.Tensor, prompt_mask: torch.Tensor,
    frequency_penalty: torch.Tensor, presence_penalty: torch.Tensor, repetition_penalty: torch.Tensor,
    bias_ids: torch.Tensor, bias_values: torch.Tensor, banned: torch.Tensor, block: int | None = None,
) -> torch.Tensor:
    logits = rows_f32(logits)
    b, v = logits.shape
    out = torch.empty((b, v), dtype=torch.float32, device=logits.device)
    if b == 0:
        return out
    if output_counts.stride(1) != 1 or prompt_mask.stride(1) != 1:
        raise ValueError("output_counts and prompt_mask need contiguous rows")
    bias_ids = _ids(bias_ids, b)
    banned = _ids(banned, b)
    block = block or (4096 if INTERPRET else 1024)
    _penalties_kernel[(b, triton.cdiv(v, block))](
        logits, out, logits.stride(0), out.stride(0), vec(req_slots, torch.int64), output_counts.to(torch.int32),
        output_counts.stride(0), prompt_mask.view(torch.uint8), prompt_mask.stride(0),
        vec(frequency_penalty, torch.float32), vec(presence_penalty, torch.float32),
        vec(repetition_penalty, torch.float32), bias_ids, vec(bias_values, torch.float32), bias_ids.shape[1],
        banned, banned.shape[1], v, BLOCK=block, CHUNK=LIST_CHUNK, **OPTIONS,
    )
    return out
