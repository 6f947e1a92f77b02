"""Triton kernels behind batonlm.kernels.sampling (imported on first use, see there).

One program per row loops over the vocabulary in blocks. Nothing is sorted: the top-k and top-p
thresholds are found by a search over the float32 bit patterns of the probabilities (monotone
for non-negative floats), NT candidate thresholds per pass over the row, so the search lands
exactly on a probability the row holds. Probabilities are recomputed in every pass rather than
stored: a pass is memory-bound either way, and this needs no [B, V] scratch buffer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batonlm.kernels._triton_common import (
    INTERPRET,
    NO_FMA,
    block_size,
    device_fn,
    exp,
    exp_sum,
    log,
    row_max_argmax,
    rows_f32,
    vec,
)

# Must equal the constants of batonlm.kernels.sampling (the tests check the hash bit for bit).
_M1: tl.constexpr = tl.constexpr(0x7FEB352D)
_M2: tl.constexpr = tl.constexpr(0x846CA68B)
_SEED_SALT: tl.constexpr = tl.constexpr(0x9E3779B9)
_TOKEN_SALT: tl.constexpr = tl.constexpr(0xC2B2AE35)
_U_SCALE: tl.constexpr = tl.constexpr(1.0 / (1 << 24))
_U_MAX: tl.constexpr = tl.constexpr(1.0 - 1.0 / (1 << 24))


def search_width(block: int) -> int:
    """Candidate thresholds per search pass (a pass settles log2 of it of the 30 bits a
    probability has): as many as keep the [block, width] tile small."""
    tile = (1 << 17) if INTERPRET else (1 << 14)
    return max(16, min(1024, tile // block))


@device_fn
def _mix32(x):
    # uint32 arithmetic wraps mod 2**32, which the torch reference emulates in int64.
    x = x ^ (x >> 16)
    x = x * _M1
    x = x ^ (x >> 15)
    x = x * _M2
    return x ^ (x >> 16)


@device_fn
def _uniform(key, offs):
    """The counter uniforms of tokens offs for a uint32 row key (sampling.counter_uniform)."""
    salt = _mix32(offs.to(tl.uint32) * _TOKEN_SALT + _SEED_SALT)
    h = _mix32(key ^ salt)
    u = ((h >> 8).to(tl.float32) + 0.5) * _U_SCALE
    return tl.minimum(u, _U_MAX)


@device_fn
def _probs(row_ptr, offs, V, temp, z_max, s, PROBS_IN: tl.constexpr):
    """Probabilities of tokens offs, computed as torch.softmax(x / temp) does; lanes past the
    vocabulary get -1 so that no threshold counts them."""
    valid = offs < V
    if PROBS_IN:
        p = tl.load(row_ptr + offs, mask=valid, other=-1.0)
    else:
        x = tl.load(row_ptr + offs, mask=valid, other=float("-inf"))
        e = exp(tl.math.div_rn(x, temp) - z_max)
        p = tl.where(valid, tl.math.div_rn(e, s), -1.0)
    return p


@device_fn
def _count_mass(row_ptr, V, temp, z_max, s, cand, PROBS_IN: tl.constexpr, BLOCK: tl.constexpr,
                NT: tl.constexpr):
    """For each candidate threshold c: count and mass of the probabilities p >= c."""
    counts = tl.zeros([NT], tl.int32)
    masses = tl.zeros([NT], tl.float32)
    for start in range(0, V, BLOCK):
        p = _probs(row_ptr, start + tl.arange(0, BLOCK), V, temp, z_max, s, PROBS_IN)
        ge = p[:, None] >= cand[None, :]
        counts += tl.sum(ge.to(tl.int32), axis=0)
        masses += tl.sum(tl.where(ge, p[:, None], 0.0), axis=0)
    return counts, masses


@device_fn
def _search(row_ptr, V, temp, z_max, s, lo, hi, mass_lo, k, target, BY_COUNT: tl.constexpr,
            PROBS_IN: tl.constexpr, BLOCK: tl.constexpr, NT: tl.constexpr):
    """The largest bit pattern t in [lo, hi) with count(p >= t) >= k (BY_COUNT) or
    mass(p >= t) >= target, given that lo passes and hi fails; returns t and mass(p >= t).

    Both predicates fall as t rises, so the passing candidates of a pass are a prefix, and the
    answer is a probability of the row, as only there can the predicate change."""
    j = tl.arange(0, NT).to(tl.int64)
    while hi - lo > 1:
        cand_bits = lo + ((hi - lo) * j) // NT  # j = 0 is lo itself, which passes
        cand = cand_bits.to(tl.int32).to(tl.float32, bitcast=True)
        counts, masses = _count_mass(row_ptr, V, temp, z_max, s, cand, PROBS_IN, BLOCK, NT)
        if BY_COUNT:
            ok = counts >= k
        else:
            ok = masses >= target
        ok = ok | (j == 0)
        new_lo = tl.max(tl.where(ok, cand_bits, lo), axis=0)
        mass_lo = tl.min(tl.where(ok, masses, float("inf")), axis=0)  # the mass at new_lo
        hi = tl.min(tl.where(ok, hi, cand_bits), axis=0)
        lo = new_lo
    return lo, mass_lo


@device_fn
def _keep_threshold(row_ptr, V, temp, z_max, s, p_max, k, top_p, min_p, PROBS_IN: tl.constexpr,
                    BLOCK: tl.constexpr, NT: tl.constexpr):
    """max(t_k, t_p, t_m) of one row (see the sampling module docstring)."""
    hi = p_max.to(tl.int32, bitcast=True).to(tl.int64) + 1  # no p is >= the float after p_max
    lo = tl.full([], 0, tl.int64)
    mass_k = tl.full([], 0.0, tl.float32)
    if (k >= 1) & (k < V):
        lo, mass_k = _search(row_ptr, V, temp, z_max, s, lo, hi, mass_k, k, 0.0, True, PROBS_IN,
                             BLOCK, NT)
    elif top_p < 1.0:  # top-p's target needs the whole mass
        zero = tl.zeros([NT], tl.float32)
        _, masses = _count_mass(row_ptr, V, temp, z_max, s, zero, PROBS_IN, BLOCK, NT)
        mass_k = tl.max(masses, axis=0)
    t_k = lo.to(tl.int32).to(tl.float32, bitcast=True)
    t_p = tl.full([], 0.0, tl.float32)
    if top_p < 1.0:
        target = top_p * mass_k
        if target > 0.0:
            # At t >= t_k, mass(p >= t) is the mass within the top-k, and lo = t_k passes.
            lo_p, _ = _search(row_ptr, V, temp, z_max, s, lo, hi, mass_k, k, target, False,
                              PROBS_IN, BLOCK, NT)
            t_p = lo_p.to(tl.int32).to(tl.float32, bitcast=True)
        else:
            t_p = p_max
    t_m = min_p * p_max
    return tl.maximum(tl.maximum(t_k, t_p), t_m)


@device_fn
def _race(row_ptr, V, temp, z_max, s, threshold, key, BLOCK: tl.constexpr):
    """argmax over the kept tokens of p_i / E_i, E_i = -log(u_i) (an exponential race: a draw
    from the kept, renormalised distribution), first index on a tie."""
    best = tl.full([], -1.0, tl.float32)
    best_i = tl.full([], 0, tl.int32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        p = _probs(row_ptr, offs, V, temp, z_max, s, False)
        keep = (p >= threshold) & (p > 0.0)
        race = -log(_uniform(key, offs))
        score = tl.where(keep, tl.math.div_rn(p, race), -1.0)
        m, i = tl.max(score, axis=0, return_indices=True, return_indices_tie_break_left=True)
        better = m > best
        best_i = tl.where(better, start + i, best_i)
        best = tl.where(better, m, best)
    return best_i


@triton.jit
def _sample_kernel(logits_ptr, stride, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, keys_ptr,
                   out_ptr, V, BLOCK: tl.constexpr, NT: tl.constexpr):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    x_max, token = row_max_argmax(row_ptr, V, BLOCK)
    temp = tl.load(temperature_ptr + row)
    if temp > 0.0:  # else greedy: the first maximal logit
        z_max = tl.math.div_rn(x_max, temp)  # = max(x / temp): dividing by temp > 0 is monotone
        s = exp_sum(row_ptr, V, temp, z_max, BLOCK)
        p_max = tl.math.div_rn(1.0, s)  # exp(0) / s
        threshold = _keep_threshold(row_ptr, V, temp, z_max, s, p_max, tl.load(top_k_ptr + row),
                                    tl.load(top_p_ptr + row), tl.load(min_p_ptr + row), False, BLOCK, NT)
        key = tl.load(keys_ptr + row).to(tl.uint32)
        token = _race(row_ptr, V, temp, z_max, s, threshold, key, BLOCK)
    tl.store(out_ptr + row, token.to(tl.int64))


@triton.jit
def _threshold_kernel(probs_ptr, stride, top_k_ptr, top_p_ptr, min_p_ptr, out_ptr, V,
                      BLOCK: tl.constexpr, NT: tl.constexpr):
    row = tl.program_id(0)
    row_ptr = probs_ptr + row.to(tl.int64) * stride
    p_max, _ = row_max_argmax(row_ptr, V, BLOCK)
    threshold = _keep_threshold(row_ptr, V, 1.0, 0.0, 1.0, p_max, tl.load(top_k_ptr + row),
                                tl.load(top_p_ptr + row), tl.load(min_p_ptr + row), True, BLOCK, NT)
    tl.store(out_ptr + row, threshold)


@triton.jit
def _argmax_kernel(logits_ptr, stride, out_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    _, token = row_max_argmax(logits_ptr + row.to(tl.int64) * stride, V, BLOCK)
    tl.store(out_ptr + row, token.to(tl.int64))


@triton.jit
def _uniform_kernel(keys_ptr, out_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    key = tl.load(keys_ptr + row).to(tl.uint32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(out_ptr + row.to(tl.int64) * V + offs, _uniform(key, offs), mask=offs < V)


def sample(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
    min_p: torch.Tensor, keys: torch.Tensor, block: int | None = None,
) -> torch.Tensor:
    logits = rows_f32(logits)
    b, v = logits.shape
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    block = block or block_size(v)
    if b:
        _sample_kernel[(b,)](
            logits, logits.stride(0), vec(temperature, torch.float32), vec(top_k, torch.int64),
            vec(top_p, torch.float32), vec(min_p, torch.float32), vec(keys, torch.int64), out, v,
            BLOCK=block, NT=search_width(block), num_warps=8, **NO_FMA,
        )
    return out


def keep_threshold(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor, block: int | None = None
) -> torch.Tensor:
    """[B] float32: the threshold max(t_k, t_p, t_m) of each row of probabilities."""
    probs = rows_f32(probs)
    b, v = probs.shape
    out = torch.empty(b, dtype=torch.float32, device=probs.device)
    block = block or block_size(v)
    if b:
        _threshold_kernel[(b,)](
            probs, probs.stride(0), vec(top_k, torch.int64), vec(top_p, torch.float32),
            vec(min_p, torch.float32), out, v, BLOCK=block, NT=search_width(block), num_warps=8, **NO_FMA,
        )
    return out


def argmax(logits: torch.Tensor, block: int | None = None) -> torch.Tensor:
    logits = rows_f32(logits)
    b, v = logits.shape
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    if b:
        _argmax_kernel[(b,)](logits, logits.stride(0), out, v, BLOCK=block or block_size(v), num_warps=4, **NO_FMA)
    return out


def uniform(keys: torch.Tensor, vocab_size: int, block: int | None = None) -> torch.Tensor:
    out = torch.empty(keys.shape[0], vocab_size, dtype=torch.float32, device=keys.device)
    if keys.shape[0]:
        _uniform_kernel[(keys.shape[0],)](vec(keys, torch.int64), out, vocab_size,
                                          BLOCK=block or block_size(vocab_size), num_warps=4, **NO_FMA)
    return out
