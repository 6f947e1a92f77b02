"""Triton kernels behind batonlm.kernels.attention (imported on first use, see there).

Both kernels read keys and values straight from the head-major pool ([H_kv, slots, D] per layer)
through the req-to-token table; nothing is gathered or padded. Softmax is online (running max
and sum, FlashAttention's recurrence) in float32. Products are tl.dot over tiles of at least 16
(a head dim or a group below that is zero-padded, which changes no dot product), in IEEE float32
for float32 queries (no TF32 rounding) and with float32 accumulation for half ones.

An FP8 pool's tiles are loaded as FP8 and converted to the queries' dtype (exact: every e4m3 and
e5m2 value is a float16, bfloat16 and float32 value), so the products are those of the pool's
dtype; the layer's scales are arguments: k_scale multiplies the scores (with the softmax
scale), v_scale the normalised output. The interpreter (triton 3.9) loads and converts FP8
tensors as the compiled kernels do, for every finite value (its NaN/inf encodings differ from
torch's, and the pool never holds one: writes clamp), so the CPU tests run this code as is.

Attention sinks (a logit per query head, float32) join the softmax's denominator once every key
is folded in: the extend kernel's running max and sum take the sink as one more score with no
value; the decode merge does the same over its parts' log-sum-exps.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batonlm.kernels._triton_common import INTERPRET, NO_FMA, exp, log, tanh
from batonlm.kernels.attention import PagedBatch

NEG_INF: tl.constexpr = tl.constexpr(float("-inf"))


@triton.jit
def _scores(q, k, IEEE: tl.constexpr):
    """[M, D] x [N, D] -> [M, N] float32."""
    if IEEE:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    return s


@triton.jit
def _weighted(p, v, IEEE: tl.constexpr):
    """[M, N] float32 weights x [N, D] -> [M, D] float32."""
    if IEEE:
        o = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        o = tl.dot(p.to(v.dtype), v)
    return o


@triton.jit
def _attend_block(q, m_i, l_i, acc, k_ptr, v_ptr, r2t_row, k_stride_s, start, hi, q_pos, offs_d, d_valid,
                  scale, window, softcap, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr,
                  IEEE: tl.constexpr):
    """One block of keys [start, start + BLOCK_N) (those < hi) folded into the running softmax."""
    offs_n = start + tl.arange(0, BLOCK_N)
    n_valid = offs_n < hi
    kv_slot = tl.load(r2t_row + offs_n, mask=n_valid, other=0)
    kv_off = kv_slot.to(tl.int64)[:, None] * k_stride_s + offs_d[None, :]
    kv_mask = n_valid[:, None] & d_valid[None, :]
    k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0).to(q.dtype)  # FP8 pools: exact
    v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
    s = _scores(q, k, IEEE) * scale
    if HAS_SOFTCAP:  # Gemma 2: cap * tanh(s / cap), before the mask
        s = tanh(s / softcap) * softcap
    visible = (offs_n[None, :] <= q_pos[:, None]) & n_valid[None, :]
    if HAS_WINDOW:
        visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
    s = tl.where(visible, s, NEG_INF)
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == NEG_INF, 0.0, m_new)  # a row that has seen no key yet
    alpha = exp(m_i - m_safe)
    p = exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _weighted(p, v, IEEE)
    return m_new, l_i, acc


@triton.jit
def _extend_kernel(q_ptr, k_ptr, v_ptr, o_ptr, r2t_ptr, r2t_stride, slots_ptr, prefix_ptr, ext_ptr, starts_ptr,
                   q_stride_t, q_stride_h, k_stride_h, k_stride_s, o_stride_t, o_stride_h, scale, k_scale, v_scale,
                   window, softcap, sinks_ptr, D, GROUP: tl.constexpr, HAS_WINDOW: tl.constexpr,
                   HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    block = tl.program_id(2)
    n = tl.load(ext_ptr + row)
    if block * BLOCK_M < n:
        prefix = tl.load(prefix_ptr + row)
        first = tl.load(starts_ptr + row)
        r2t_row = r2t_ptr + tl.load(slots_ptr + row).to(tl.int64) * r2t_stride
        kv_head = head // GROUP
        offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
        m_valid = offs_m < n
        q_pos = prefix + offs_m
        offs_d = tl.arange(0, BLOCK_D)
        d_valid = offs_d < D
        q_off = (first + offs_m).to(tl.int64)[:, None] * q_stride_t + head * q_stride_h + offs_d[None, :]
        q = tl.load(q_ptr + q_off, mask=m_valid[:, None] & d_valid[None, :], other=0.0)
        m_i = tl.full([BLOCK_M], NEG_INF, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        hi = prefix + tl.minimum(n, (block + 1) * BLOCK_M)  # past the block's last query
        lo = 0
        if HAS_WINDOW:
            lo = tl.maximum(0, prefix + block * BLOCK_M - window + 1) // BLOCK_N * BLOCK_N
        k_head = k_ptr + kv_head.to(tl.int64) * k_stride_h
        v_head = v_ptr + kv_head.to(tl.int64) * k_stride_h
        qk_scale = scale * k_scale
        for start in range(lo, hi, BLOCK_N):
            m_i, l_i, acc = _attend_block(q, m_i, l_i, acc, k_head, v_head, r2t_row, k_stride_s, start, hi, q_pos,
                                          offs_d, d_valid, qk_scale, window, softcap, HAS_WINDOW, HAS_SOFTCAP,
                                          BLOCK_N, IEEE)
        if HAS_SINKS:  # one more score, exp(sink), in the denominator only
            sink = tl.load(sinks_ptr + head).to(tl.float32)
            m_all = tl.maximum(m_i, sink)
            alpha = exp(m_i - m_all)
            l_i = l_i * alpha + exp(sink - m_all)
            acc = acc * alpha[:, None]
        out = acc * (v_scale / tl.where(l_i > 0, l_i, 1.0))[:, None]
        o_off = (first + offs_m).to(tl.int64)[:, None] * o_stride_t + head * o_stride_h + offs_d[None, :]
        tl.store(o_ptr + o_off, out, mask=m_valid[:, None] & d_valid[None, :])


@triton.jit
def _decode_split_kernel(q_ptr, k_ptr, v_ptr, part_ptr, lse_ptr, r2t_ptr, r2t_stride, slots_ptr, prefix_ptr,
                         starts_ptr, q_stride_t, q_stride_h, k_stride_h, k_stride_s, scale, k_scale, v_scale, window,
                         softcap, D, H, SPLITS: tl.constexpr, GROUP: tl.constexpr, HAS_WINDOW: tl.constexpr,
                         HAS_SOFTCAP: tl.constexpr,
                         BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                         IEEE: tl.constexpr):
    """The query heads of one KV head, one row, over one part of its context -> a partial
    output (normalised) and its log-sum-exp, for each head."""
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(prefix_ptr + row) + 1
    q_pos = length - 1
    lo_all = 0
    if HAS_WINDOW:
        lo_all = tl.maximum(0, length - window)
    per = tl.cdiv(tl.cdiv(length - lo_all, SPLITS), BLOCK_N) * BLOCK_N
    lo = lo_all + split * per
    hi = tl.minimum(lo + per, length)
    r2t_row = r2t_ptr + tl.load(slots_ptr + row).to(tl.int64) * r2t_stride
    offs_g = tl.arange(0, BLOCK_G)
    g_valid = offs_g < GROUP
    heads = kv_head * GROUP + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < D
    token = tl.load(starts_ptr + row).to(tl.int64)
    q = tl.load(q_ptr + token * q_stride_t + heads[:, None] * q_stride_h + offs_d[None, :],
                mask=g_valid[:, None] & d_valid[None, :], other=0.0)
    m_i = tl.full([BLOCK_G], NEG_INF, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    positions = tl.zeros([BLOCK_G], tl.int64) + q_pos
    k_head = k_ptr + kv_head.to(tl.int64) * k_stride_h
    v_head = v_ptr + kv_head.to(tl.int64) * k_stride_h
    qk_scale = scale * k_scale
    for start in range(lo, hi, BLOCK_N):
        m_i, l_i, acc = _attend_block(q, m_i, l_i, acc, k_head, v_head, r2t_row, k_stride_s, start, hi, positions,
                                      offs_d, d_valid, qk_scale, window, softcap, HAS_WINDOW, HAS_SOFTCAP, BLOCK_N,
                                      IEEE)
    lse = tl.where(l_i > 0, tl.where(m_i == NEG_INF, 0.0, m_i) + log(tl.where(l_i > 0, l_i, 1.0)), NEG_INF)
    out = acc * (v_scale / tl.where(l_i > 0, l_i, 1.0))[:, None]
    part = ((row * H + heads).to(tl.int64) * SPLITS + split)
    tl.store(part_ptr + part[:, None] * D + offs_d[None, :], out, mask=g_valid[:, None] & d_valid[None, :])
    tl.store(lse_ptr + part, lse, mask=g_valid)


@triton.jit
def _decode_merge_kernel(part_ptr, lse_ptr, o_ptr, starts_ptr, sinks_ptr, o_stride_t, o_stride_h, D, H,
                         SPLITS: tl.constexpr, HAS_SINKS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    s_valid = offs_s < SPLITS
    base = (row * H + head).to(tl.int64) * SPLITS
    lse = tl.load(lse_ptr + base + offs_s, mask=s_valid, other=NEG_INF)
    m = tl.max(lse, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        m = tl.maximum(m, sink)
    w = tl.where(s_valid & (lse > NEG_INF), exp(lse - m), 0.0)
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < D
    parts = tl.load(part_ptr + (base + offs_s)[:, None] * D + offs_d[None, :],
                    mask=s_valid[:, None] & d_valid[None, :], other=0.0)
    total = tl.sum(w, axis=0)
    if HAS_SINKS:  # the sink's term in the denominator, no value with it
        total += exp(sink - m)
    out = tl.sum(w[:, None] * parts, axis=0) / total
    token = tl.load(starts_ptr + row).to(tl.int64)
    tl.store(o_ptr + token * o_stride_t + head * o_stride_h + offs_d, out, mask=d_valid)


def _sinks(sinks: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """The sinks as the kernels read them, float32 (a placeholder where there are none)."""
    return like if sinks is None else sinks.to(torch.float32).contiguous()


def _vec(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.int64).contiguous()


def _dims(q: torch.Tensor, k_pool: torch.Tensor) -> tuple[int, int, int, bool]:
    heads, d = q.shape[1], q.shape[2]
    group = heads // k_pool.shape[0]
    # float32 queries: IEEE products. The interpreter's bfloat16 tl.dot returns garbage (triton
    # 3.9), so interpreted bfloat16 tiles are multiplied in float32 as well; compiled ones use
    # the tensor cores (the gpu tests cover them). The pool's tiles are in q's dtype by then.
    ieee = q.dtype == torch.float32 or (INTERPRET and q.dtype == torch.bfloat16)
    return heads, d, group, ieee


def extend(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, batch: PagedBatch, scale: float,
           window: int | None, k_scale: float = 1.0, v_scale: float = 1.0, softcap: float | None = None,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    heads, d, group, ieee = _dims(q, k_pool)
    b = batch.req_slots.shape[0]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    if b == 0 or q.shape[0] == 0:
        return out.to(q.dtype)
    block_d = max(16, triton.next_power_of_2(d))
    block_m = 16 if batch.max_extend_len <= 16 else (64 if INTERPRET else 32)
    block_n = 64 if INTERPRET else 32
    grid = (b, heads, triton.cdiv(batch.max_extend_len, block_m))
    q = q.contiguous()
    _extend_kernel[grid](
        q, k_pool, v_pool, out, batch.req_to_token, batch.req_to_token.stride(0), _vec(batch.req_slots),
        _vec(batch.prefix_lens), _vec(batch.extend_lens), _vec(batch.extend_starts), q.stride(0), q.stride(1),
        k_pool.stride(0), k_pool.stride(1), out.stride(0), out.stride(1), scale, k_scale, v_scale, window or 0,
        softcap or 1.0, _sinks(sinks, out), d, GROUP=group, HAS_WINDOW=window is not None,
        HAS_SOFTCAP=softcap is not None, HAS_SINKS=sinks is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=block_d, IEEE=ieee, **NO_FMA,
    )
    return out.to(q.dtype)


def default_splits(max_seq_len: int) -> int:
    """More parts for longer contexts, so that a few rows still fill the device."""
    return max(1, min(16, triton.cdiv(max_seq_len, 512)))


def decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, batch: PagedBatch, scale: float,
           window: int | None, splits: int | None, k_scale: float = 1.0, v_scale: float = 1.0,
           softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    heads, d, group, ieee = _dims(q, k_pool)
    b = batch.req_slots.shape[0]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    if b == 0:
        return out.to(q.dtype)
    if batch.max_extend_len > 1:
        raise ValueError("decode attention takes rows of one query each")
    splits = splits or default_splits(batch.max_seq_len)
    parts = torch.empty((b, heads, splits, d), dtype=torch.float32, device=q.device)
    lse = torch.empty((b, heads, splits), dtype=torch.float32, device=q.device)
    block_g = max(16, triton.next_power_of_2(group))
    block_d = max(16, triton.next_power_of_2(d))
    q = q.contiguous()
    _decode_split_kernel[(b, k_pool.shape[0], splits)](
        q, k_pool, v_pool, parts, lse, batch.req_to_token, batch.req_to_token.stride(0), _vec(batch.req_slots),
        _vec(batch.prefix_lens), _vec(batch.extend_starts), q.stride(0), q.stride(1), k_pool.stride(0),
        k_pool.stride(1), scale, k_scale, v_scale, window or 0, softcap or 1.0, d, heads, SPLITS=splits, GROUP=group,
        HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None, BLOCK_G=block_g, BLOCK_N=64 if INTERPRET else 32, BLOCK_D=block_d, IEEE=ieee, **NO_FMA,
    )
    _decode_merge_kernel[(b, heads)](
        parts, lse, out, _vec(batch.extend_starts), _sinks(sinks, out), out.stride(0), out.stride(1), d, heads,
        SPLITS=splits, HAS_SINKS=sinks is not None, BLOCK_S=max(2, triton.next_power_of_2(splits)), BLOCK_D=block_d,
        **NO_FMA,
    )
    return out.to(q.dtype)
