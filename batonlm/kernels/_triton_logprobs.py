"""Triton kernel behind batonlm.kernels.logprobs (imported on first use).

A program per row: a max pass, a sum-of-exp pass, then one pass that reads the chosen token's
logprob and keeps the running top-n in registers. A block is merged into the running list only
where it beats the list's worst entry, best first, so after the first blocks most blocks cost
one comparison; nothing is sorted.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batonlm.kernels._triton_common import (
    NO_FMA,
    block_size,
    device_fn,
    exp_sum,
    log,
    row_max_argmax,
    rows_f32,
    vec,
)

_BIG: tl.constexpr = tl.constexpr(2**31 - 1)


@device_fn
def _worst(r_val, r_id):
    """The worst entry of the running list: lowest logprob, then highest id."""
    w_val = tl.min(r_val, axis=0)
    w_id = tl.max(tl.where(r_val == w_val, r_id, -1), axis=0)
    return w_val, w_id


@device_fn
def _beats(val, ids, w_val, w_id):
    return (val > w_val) | ((val == w_val) & (ids < w_id))


@triton.jit
def _logprobs_kernel(logits_ptr, stride, temperature_ptr, chosen_ptr, chosen_out_ptr, top_ids_ptr,
                     top_lp_ptr, V, top_n, BLOCK: tl.constexpr, NP: tl.constexpr, WITH_TOP: tl.constexpr):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    temp = tl.load(temperature_ptr + row)
    temp = tl.where(temp > 0.0, temp, 1.0)
    x_max, _ = row_max_argmax(row_ptr, V, BLOCK)
    z_max = tl.math.div_rn(x_max, temp)
    log_s = log(exp_sum(row_ptr, V, temp, z_max, BLOCK))
    # (z - max) - log(sum), in torch.log_softmax's order of operations.
    x_c = tl.load(row_ptr + tl.load(chosen_ptr + row))
    tl.store(chosen_out_ptr + row, (tl.math.div_rn(x_c, temp) - z_max) - log_s)
    if WITH_TOP:
        slots = tl.arange(0, NP)
        # Sentinels: -inf with ids past the vocabulary, so that any real token (even at -inf) beats them.
        r_val = tl.full([NP], float("-inf"), tl.float32)
        r_id = V + slots
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf"))
            val = (tl.math.div_rn(x, temp) - z_max) - log_s
            w_val, w_id = _worst(r_val, r_id)
            cand = (offs < V) & _beats(val, offs, w_val, w_id)
            n_cand = tl.sum(cand.to(tl.int32), axis=0)
            while n_cand > 0:
                # The block's best candidate replaces the list's worst entry.
                b_val = tl.max(tl.where(cand, val, float("-inf")), axis=0)
                b_id = tl.min(tl.where(cand & (val == b_val), offs, _BIG), axis=0)
                replace = r_id == w_id
                r_val = tl.where(replace, b_val, r_val)
                r_id = tl.where(replace, b_id, r_id)
                w_val, w_id = _worst(r_val, r_id)
                cand = cand & (offs != b_id) & _beats(val, offs, w_val, w_id)
                n_cand = tl.sum(cand.to(tl.int32), axis=0)
        # Emit the list best first.
        left = slots >= 0
        out = row.to(tl.int64) * top_n
        for j in range(0, top_n):
            b_val = tl.max(tl.where(left, r_val, float("-inf")), axis=0)
            b_id = tl.min(tl.where(left & (r_val == b_val), r_id, _BIG), axis=0)
            tl.store(top_ids_ptr + out + j, b_id.to(tl.int64))
            tl.store(top_lp_ptr + out + j, b_val)
            left = left & (r_id != b_id)


def logprobs(
    logits: torch.Tensor, temperature: torch.Tensor, chosen: torch.Tensor, top_n: int, block: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logits = rows_f32(logits)
    b, v = logits.shape
    dev = logits.device
    chosen_lp = torch.empty(b, dtype=torch.float32, device=dev)
    top_ids = torch.empty((b, top_n), dtype=torch.int64, device=dev)
    top_lp = torch.empty((b, top_n), dtype=torch.float32, device=dev)
    if b:
        _logprobs_kernel[(b,)](
            logits, logits.stride(0), vec(temperature, torch.float32), vec(chosen, torch.int64), chosen_lp,
            top_ids, top_lp, v, top_n, BLOCK=block or block_size(v), NP=triton.next_power_of_2(max(top_n, 1)),
            WITH_TOP=top_n > 0, num_warps=8, **NO_FMA,
        )
    return chosen_lp, top_ids, top_lp
