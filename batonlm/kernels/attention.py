"""Attention over the token-level KV pool: a torch reference and its Triton twins.

Every query attends, through its request's row of the req-to-token table, to the keys at
positions up to its own (causal), and with a sliding window W only to the last W of them. The
new tokens' keys and values are in the pool already (the backend writes them first), so a
prefill, a chunk on a cached prefix and a decode step are one computation:

    out[t, h] = softmax_j(scale * q[t, h] . k[h_kv, slot(j)]) . v[h_kv, slot(j)],
    j over positions max(0, p - W + 1) .. p, p = the query's position, h_kv = h // (H / H_kv),

with logit soft-capping (Gemma 2) each score s becomes cap * tanh(s / cap) before the softmax.
With attention sinks (gpt-oss: a learned logit per query head, `sinks` [H] float32) the softmax's
denominator has one more term, exp(sink[h]), that no value goes with: the weights sum to less
than one, softmax over [scores, sink] with the sink's weight dropped.

An FP8 pool (`--kv-cache-dtype`) holds k / k_scale and v / v_scale rounded to FP8: every
function takes the layer's two scales and reads the pool as `stored * scale` (1.0: as stored).

Batch struct: `PagedBatch` (the rows' request slots, prefix and extend lengths). Kernels:
`extend_attention_triton` (any rows; a program per (row, head, block of queries)) and
`decode_attention_triton` (rows of one query; split-KV flash-decoding: the context is cut in
`splits` parts computed in parallel, then merged by their log-sum-exps).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedBatch:
    req_to_token: torch.Tensor  # [R, C] int64: KV slot of each (request slot, position)
    req_slots: torch.Tensor  # [B] int64
    prefix_lens: torch.Tensor  # [B] int64: positions before this call's tokens
    extend_lens: torch.Tensor  # [B] int64: this call's tokens per row (1 for a decode row)
    extend_starts: torch.Tensor  # [B] int64: each row's first token in the flat [T] layout
    max_extend_len: int  # host-side facts: grid sizes need no device sync
    max_seq_len: int


def paged_attention_reference(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, batch: PagedBatch, scale: float,
    window: int | None = None, k_scale: float = 1.0, v_scale: float = 1.0, softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, H, D], k_pool / v_pool [H_kv, slots, D] (read as stored * k_scale / v_scale) ->
    [T, H, D] (in q's dtype; float32 math, float64 for a float64 q)."""
    t_total, heads, d = q.shape
    kv_heads = k_pool.shape[0]
    group = heads // kv_heads
    math_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.empty_like(q)
    for b in range(batch.req_slots.shape[0]):
        start, n = int(batch.extend_starts[b]), int(batch.extend_lens[b])
        p = int(batch.prefix_lens[b])
        length = p + n
        slots = batch.req_to_token[batch.req_slots[b], :length]
        k = k_pool[:, slots].to(math_dtype) * k_scale  # [H_kv, L, D]
        v = v_pool[:, slots].to(math_dtype) * v_scale
        qb = q[start : start + n].to(math_dtype).reshape(n, kv_heads, group, d)
        scores = torch.einsum("nkgd,kld->kgnl", qb, k) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = p + torch.arange(n, device=q.device)
        k_pos = torch.arange(length, device=q.device)
        visible = k_pos[None, :] <= q_pos[:, None]
        if window is not None:
            visible &= k_pos[None, :] > q_pos[:, None] - window
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:  # one more logit per head, its weight dropped
            sink = sinks.to(math_dtype).reshape(kv_heads, group, 1, 1).expand(kv_heads, group, n, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        ob = torch.einsum("kgnl,kld->nkgd", probs, v).reshape(n, heads, d)
        out[start : start + n] = ob.to(q.dtype)
    return out


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _check(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, sinks: torch.Tensor | None = None) -> None:
    if q.dim() != 3 or k_pool.dim() != 3 or k_pool.shape != v_pool.shape:
        raise ValueError(f"expected q [T, H, D] and pools [H_kv, S, D], got {tuple(q.shape)}, {tuple(k_pool.shape)}")
    if k_pool.dtype != v_pool.dtype or (k_pool.dtype != q.dtype and k_pool.dtype not in _FP8):
        raise ValueError(f"pools of {k_pool.dtype} / {v_pool.dtype} for queries of {q.dtype}: a pool holds the "
                         "queries' dtype or FP8 (e4m3fn, e5m2)")
    if q.shape[1] % k_pool.shape[0] or q.shape[2] != k_pool.shape[2]:
        raise ValueError(f"{q.shape[1]} query heads of dim {q.shape[2]} do not fit {k_pool.shape[0]} KV heads "
                         f"of dim {k_pool.shape[2]}")
    if sinks is not None and tuple(sinks.shape) != (q.shape[1],):
        raise ValueError(f"sinks of shape {tuple(sinks.shape)} for {q.shape[1]} query heads: one logit a head")


def extend_attention_triton(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, batch: PagedBatch, scale: float,
    window: int | None = None, k_scale: float = 1.0, v_scale: float = 1.0, softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """`paged_attention_reference` for any rows: prefills, chunks on a cached prefix, decodes."""
    _check(q, k_pool, v_pool, sinks)
    # Imported on first use: triton decides between compiling and interpreting at definition.
    from batonlm.kernels import _triton_attention

    return _triton_attention.extend(q, k_pool, v_pool, batch, scale, window, k_scale, v_scale, softcap, sinks)


def decode_attention_triton(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, batch: PagedBatch, scale: float,
    window: int | None = None, splits: int | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
    softcap: float | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """`paged_attention_reference` for rows of one query each (decode steps), split-KV."""
    _check(q, k_pool, v_pool, sinks)
    from batonlm.kernels import _triton_attention

    return _triton_attention.decode(q, k_pool, v_pool, batch, scale, window, splits, k_scale, v_scale, softcap,
                                    sinks)
