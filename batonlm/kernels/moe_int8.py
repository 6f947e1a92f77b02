"""Mixture-of-experts with every expert's weights in int8 per output channel and int8 activations
per token (W8A8 int8 MoE checkpoints, llm-compressor's `W8A8`): each expert's gated MLP is
`Int8Linear`'s math twice (`batonlm.kernels.int8`): its input rows quantized to int8 per token,
the int8 product summed exactly in int32, scaled by the token's and the channel's scales; gated
in the activation dtype and quantized again for the down projection. The routed outputs are
summed as `batonlm.kernels.moe` sums them.

Weights: `w13_q` int8 [E, 2I, H] (gate rows then up rows) with `w13_scale` float32 [E, 2I], and
`w2_q` [E, H, I] with `w2_scale` [E, H].

Static activation scales (`input_scales`: llm-compressor's W8A8 with calibrated activations):
each expert's (a13 [E], a2 [E]) float32, its rows quantized by its own (`static_quant_int8`),
every expert as its own static `Int8Linear` computes; still bit for bit across formulations.

Four formulations, as for float experts:
- `fused_moe_int8_grouped`: one expert at a time over its rows, through the torch references
  (the reference, and the CPU's eager path);
- `fused_moe_int8_dense`: every expert over every token, weighted by exact zeros where not routed
  (the CPU's compiled step); a row's quantization and its exact integer products depend on that
  row alone, so each routed row's output is the grouped path's, bit for bit;
- `fused_moe_int8_gathered`: the dense math over each routed pair's gathered expert (the
  compiled step's batch-1 graph), bit for bit too;
- `fused_moe_int8_triton` (CUDA): two grouped int8 GEMM launches (`_triton_moe.grouped_gemm_int8`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batonlm.kernels.int8 import (
    int8_scaled_matmul_reference,
    int_product,
    per_token_quant_int8,
    static_quant_int8,
)
from batonlm.kernels.moe import (
    Activation,
    StaticScales,
    aligned_by_expert,
    check_input_scales,
    dense_by_expert,
    expert_scales,
    gated,
    gathered_by_expert,
    grouped_by_expert,
)


def _check(w13_q: torch.Tensor, w13_scale: torch.Tensor, w2_q: torch.Tensor, w2_scale: torch.Tensor,
           input_scales: StaticScales = None) -> None:
    e, two_i, h = w13_q.shape
    check_input_scales(input_scales, e)
    want = {"w13_q": (e, two_i, h), "w2_q": (e, h, two_i // 2)}
    for name, t in (("w13_q", w13_q), ("w2_q", w2_q)):
        if t.dtype != torch.int8 or tuple(t.shape) != want[name]:
            raise ValueError(f"{name}: expected int8 {list(want[name])}, got {t.dtype} {list(t.shape)}")
    for name, t, shape in (("w13_scale", w13_scale, (e, two_i)), ("w2_scale", w2_scale, (e, h))):
        if t.dtype != torch.float32 or tuple(t.shape) != shape:
            raise ValueError(f"{name}: expected float32 {list(shape)}, got {t.dtype} {list(t.shape)}")


def _quantized(x: torch.Tensor, a: torch.Tensor | None, use_triton: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K]'s codes and scales [M, 1]: by `a` (a static scale, 0-dim or one per row [M]), or per token."""
    if a is None:
        return per_token_quant_int8(x, use_triton=use_triton)
    s = a.reshape(-1, 1).expand(x.shape[0], 1).contiguous()
    return static_quant_int8(x, s, use_triton=use_triton), s


def _linear(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, a: torch.Tensor | None) -> torch.Tensor:
    x_q, x_s = _quantized(x, a)
    return int8_scaled_matmul_reference(x_q, x_s, w_q, w_scale, x.dtype)


def fused_moe_int8_grouped(
    x: torch.Tensor, w13_q: torch.Tensor, w13_scale: torch.Tensor, w2_q: torch.Tensor, w2_scale: torch.Tensor,
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, act: Activation = F.silu, input_scales: StaticScales = None,
) -> torch.Tensor:
    _check(w13_q, w13_scale, w2_q, w2_scale, input_scales)

    def mlp(e: int, seg: torch.Tensor) -> torch.Tensor:
        a13, a2 = expert_scales(input_scales, e)
        return _linear(gated(_linear(seg, w13_q[e], w13_scale[e], a13), act), w2_q[e], w2_scale[e], a2)

    return grouped_by_expert(x, topk_ids, topk_weights, w13_q.shape[0], w2_q.shape[1], mlp)


def _dense_linear(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, a: torch.Tensor | None) -> torch.Tensor:
    """x [T, K] (or [E, T, K]: expert e's rows for expert e) through every expert -> [E, T, N];
    `a` [E]: each expert's static input scale, its rows quantized by it."""
    e = w_q.shape[0]
    if a is not None:
        x = x.expand(e, *x.shape[-2:])
    t = x.shape[-2]
    q, s = _quantized(x.reshape(-1, x.shape[-1]), None if a is None else a[:, None].expand(e, t))
    if x.dim() == 2:
        per = [(q, s)] * e
    else:  # expert i's rows: a view per expert (slicing by a traced batch size would fix it in the graph)
        q3, s3 = q.view(e, t, -1), s.view(e, t, 1)
        per = [(q3[i], s3[i]) for i in range(e)]
    out = [(int_product(qi, w_q[i]).float() * si * w_scale[i][None, :]).to(x.dtype) for i, (qi, si) in enumerate(per)]
    return torch.stack(out)


def fused_moe_int8_dense(
    x: torch.Tensor, w13_q: torch.Tensor, w13_scale: torch.Tensor, w2_q: torch.Tensor, w2_scale: torch.Tensor,
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, act: Activation = F.silu, input_scales: StaticScales = None,
) -> torch.Tensor:
    _check(w13_q, w13_scale, w2_q, w2_scale, input_scales)
    a13, a2 = input_scales or (None, None)

    def mlp(x: torch.Tensor) -> torch.Tensor:
        return _dense_linear(gated(_dense_linear(x, w13_q, w13_scale, a13), act), w2_q, w2_scale, a2)  # [E, T, H]

    return dense_by_expert(x, topk_ids, topk_weights, w13_q.shape[0], mlp)


def fused_moe_int8_gathered(
    x: torch.Tensor, w13_q: torch.Tensor, w13_scale: torch.Tensor, w2_q: torch.Tensor, w2_scale: torch.Tensor,
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, act: Activation = F.silu, input_scales: StaticScales = None,
) -> torch.Tensor:
    """Each routed pair's expert gathered, the dense math pair by pair (an int8 GEMM per pair: the
    compiled step takes it for one token, K pairs, a number its graph fixes)."""
    _check(w13_q, w13_scale, w2_q, w2_scale, input_scales)

    def mlp(rows: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        a13, a2 = expert_scales(input_scales, e)
        return _dense_linear(gated(_dense_linear(rows, w13_q[e], w13_scale[e], a13), act), w2_q[e], w2_scale[e], a2)

    return gathered_by_expert(x, topk_ids, topk_weights, mlp)


def fused_moe_int8_triton(
    x: torch.Tensor, w13_q: torch.Tensor, w13_scale: torch.Tensor, w2_q: torch.Tensor, w2_scale: torch.Tensor,
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, act: Activation = F.silu, input_scales: StaticScales = None,
) -> torch.Tensor:
    """Two grouped int8 GEMM launches (with static scales the first reads pair rows, each
    quantized by its expert's scale)."""
    from batonlm.kernels import _triton_moe

    _check(w13_q, w13_scale, w2_q, w2_scale, input_scales)
    pairs, k = topk_ids.numel(), topk_ids.shape[1]

    def mlp(sorted_ids: torch.Tensor, block_expert: torch.Tensor, pair_expert: torch.Tensor) -> torch.Tensor:
        a13, a2 = expert_scales(input_scales, pair_expert)
        rows, div = (x, k) if a13 is None else (x.repeat_interleave(k, dim=0), 1)
        x_q, x_s = _quantized(rows, a13, use_triton=True)
        h = _triton_moe.grouped_gemm_int8(x_q, x_s, w13_q, w13_scale, sorted_ids, block_expert, pairs, div, x.dtype)
        g_q, g_s = _quantized(gated(h, act), a2, use_triton=True)
        return _triton_moe.grouped_gemm_int8(g_q, g_s, w2_q, w2_scale, sorted_ids, block_expert, pairs, 1, x.dtype)

    return aligned_by_expert(x, topk_ids, topk_weights, w13_q.shape[0], mlp)
