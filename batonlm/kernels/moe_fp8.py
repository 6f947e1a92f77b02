"""Mixture-of-experts with every expert's weights in FP8, in blocks (DeepSeek-V3, Qwen3-MoE FP8)
or per output channel (llm-compressor's FP8_DYNAMIC, `--quantization fp8` online): each expert's
gated MLP is `Fp8Linear`'s W8A8 math twice. Its input rows are quantized to FP8 e4m3 per token
and group of bk columns (per token, one group, with channel scales; `per_token_group_quant_fp8`),
multiplied by the expert's fused gate/up weight with its scales (`fp8_block_matmul` /
`fp8_scaled_matmul`), gated in the activation dtype, quantized again the same way and
multiplied by its down weight. The routed
outputs are summed as `batonlm.kernels.moe` sums them (ascending expert order, each product
rounded to the activation dtype).

Weights: `w13_q` [E, 2I, H] FP8 (gate rows then up rows) with `w13_scale` [E, 2I / bn, ceil(H /
bk)], and `w2_q` [E, H, I] with `w2_scale` [E, ceil(H / bn), ceil(I / bk)], float32: weight =
code * the scale of its (bn, bk) block. I is a multiple of bn, so a block never holds both gate
and up rows. `block` None: `w13_scale` [E, 2I] and `w2_scale` [E, H], one per output row.

On the CPU `w13_q` / `w2_q` may be the torch references' float32 weight operands instead of the
codes (`float_operand`: the codes as float32 per channel, dequantized by their blocks in blocks;
`Fp8Experts` keeps them from load): the grouped, dense and gathered formulations then skip that
conversion at every call, with the same operations on the same values after it.

Static activation scales (`input_scales`, per channel only: AutoFP8's and llm-compressor's FP8
checkpoints, Mixtral-8x7B-FP8): each expert's calibrated (a13 [E], a2 [E]) float32, its gate/up
input divided by a13[e] and its gated intermediate by a2[e] (`static_quant_fp8`, saturating),
each row's product scaled by its expert's scale: every expert as its own `Fp8Linear` with a
static `input_scale` computes (other engines take the largest of the experts' scales for all).

Four formulations of the same sum, as for float experts:
- `fused_moe_fp8_grouped`: one expert at a time over the rows routed to it, through the torch
  references of `batonlm.kernels.quant` (the reference, and the CPU's eager path);
- `fused_moe_fp8_dense`: every expert over every token, weighted by exact zeros where not routed
  (shapes depend on the batch size only: the CPU's compiled step); each row's products are the
  grouped path's (a row's quantization and product depend on that row alone);
- `fused_moe_fp8_gathered`: the dense math over each routed pair's gathered expert (T * K
  experts read rather than E: the compiled step's batch-1 graph);
- `fused_moe_fp8_triton` (CUDA): two grouped GEMM launches over FP8 tiles with the block scales
  applied per K block (`_triton_moe.grouped_gemm_fp8`), every shape fixed by the batch size (a
  CUDA graph captures it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
from batonlm.kernels.quant import (
    dequantize_fp8_block,
    fp8_block_matmul_reference,
    fp8_block_product,
    fp8_scaled_matmul_reference,
    fp8_scaled_product,
    per_token_group_quant_fp8,
    per_token_group_quant_fp8_reference,
    static_quant_fp8,
    static_quant_fp8_reference,
)

Block = tuple[int, int] | None  # (bn, bk), or None: one scale per output channel


def _check(w13_q: torch.Tensor, w13_scale: torch.Tensor, w2_q: torch.Tensor, w2_scale: torch.Tensor,
           block: Block, input_scales: StaticScales = None) -> None:
    e, two_i, h = w13_q.shape
    check_input_scales(input_scales, e, block is None)
    bn, bk = block or (1, 0)
    want: dict[str, tuple[int, ...]]
    if block is None:
        want = {"w13_scale": (e, two_i), "w2_scale": (e, h)}
    else:
        want = {"w13_scale": (e, -(-two_i // bn), -(-h // bk)), "w2_scale": (e, -(-h // bn), -(-w2_q.shape[2] // bk))}
    for name, t in (("w13_scale", w13_scale), ("w2_scale", w2_scale)):
        if tuple(t.shape) != want[name] or t.dtype != torch.float32:
            raise ValueError(f"{name}: expected float32 {list(want[name])}, got {t.dtype} {list(t.shape)}")
    if w2_q.shape != (e, h, two_i // 2) or (two_i // 2) % bn:
        raise ValueError(f"w2_q: expected [{e}, {h}, {two_i // 2}] with I a multiple of {bn}, got "
                         f"{list(w2_q.shape)} (I = {two_i // 2})")


def _group(x: torch.Tensor, block: Block) -> int:
    """The activation quantization's group: the block's K, or the whole row (per token)."""
    return block[1] if block is not None else max(1, x.shape[-1])


def float_operand(w_q: torch.Tensor, w_scale: torch.Tensor, block: Block) -> torch.Tensor:
    """Experts' FP8 codes [E, N, K] as the torch references multiply them: float32, dequantized
    by their blocks (in blocks) or as they are (per channel: the scales come after the product)."""
    if block is None:
        return w_q.float()
    return torch.stack([dequantize_fp8_block(w_q[i], w_scale[i], block, torch.float32) for i in range(w_q.shape[0])])


def _operand(w: torch.Tensor) -> bool:
    return w.dtype == torch.float32


def _quantized_linear(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, block: Block,
                      a: torch.Tensor | None = None) -> torch.Tensor:
    """One expert's product; `a`: its static input scale (0-dim), else dynamic per token."""
    if a is not None:
        x_q, xs = static_quant_fp8_reference(x, a), a
    else:
        x_q, xs = per_token_group_quant_fp8_reference(x, _group(x, block))
    if block is None:
        if _operand(w_q):
            return fp8_scaled_product(x_q, xs.reshape(-1, 1), w_q, w_scale.reshape(-1, 1), x.dtype)
        return fp8_scaled_matmul_reference(x_q, xs, w_q, w_scale, x.dtype)
    if _operand(w_q):
        return fp8_block_product(x_q, xs, w_q, block[1], x.dtype)
    return fp8_block_matmul_reference(x_q, xs, w_q, w_scale, block, x.dtype)


def fused_moe_fp8_grouped(
    x: torch.Tensor, w13_q: torch.Tensor, w13_scale: torch.Tensor, w2_q: torch.Tensor, w2_scale: torch.Tensor,
    block: Block, topk_ids: torch.Tensor, topk_weights: torch.Tensor, act: Activation = F.silu,
    input_scales: StaticScales = None,
) -> torch.Tensor:
    _check(w13_q, w13_scale, w2_q, w2_scale, block, input_scales)

    def mlp(e: int, seg: torch.Tensor) -> torch.Tensor:
        a13, a2 = expert_scales(input_scales, e)
        h = gated(_quantized_linear(seg, w13_q[e], w13_scale[e], block, a13), act)
        return _quantized_linear(h, w2_q[e], w2_scale[e], block, a2)

    return grouped_by_expert(x, topk_ids, topk_weights, w13_q.shape[0], w2_q.shape[1], mlp)


def _dense_linear(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, block: Block,
                  a: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., T, K] through every expert's weight [E, N, K] -> [E, T, N] in x's dtype: each row
    as `_quantized_linear` computes it (per block: the dequantized operands multiplied; per
    channel: the codes multiplied, then both scales); `a` [E]: each expert's static input scale,
    its rows quantized by it."""
    k = x.shape[-1]
    group = _group(x, block)
    if a is not None:  # each expert's rows, quantized by its scale
        x = x.expand(w_q.shape[0], *x.shape[-2:])
        s = a[:, None, None].expand(*x.shape[:-1], 1).reshape(-1, 1)
        q = static_quant_fp8_reference(x.reshape(-1, k), s)
    else:
        q, s = per_token_group_quant_fp8_reference(x.reshape(-1, k), group)
    shape = (*x.shape[:-1], -1)
    if block is None:
        y = torch.matmul(q.float().view(*x.shape), w_q.float().transpose(1, 2)) * (s.view(shape) * w_scale[:, None, :])
        return y.to(x.dtype)
    x_d = (q.float() * s.repeat_interleave(group, dim=1)[:, :k]).view(x.shape)
    w = w_q if _operand(w_q) else float_operand(w_q, w_scale, block)
    return torch.matmul(x_d, w.transpose(1, 2)).to(x.dtype)


def fused_moe_fp8_dense(
    x: torch.Tensor, w13_q: torch.Tensor, w13_scale: torch.Tensor, w2_q: torch.Tensor, w2_scale: torch.Tensor,
    block: Block, topk_ids: torch.Tensor, topk_weights: torch.Tensor, act: Activation = F.silu,
    input_scales: StaticScales = None,
) -> torch.Tensor:
    _check(w13_q, w13_scale, w2_q, w2_scale, block, input_scales)
    a13, a2 = input_scales or (None, None)

    def mlp(x: torch.Tensor) -> torch.Tensor:
        return _dense_linear(gated(_dense_linear(x, w13_q, w13_scale, block, a13), act), w2_q, w2_scale, block, a2)

    return dense_by_expert(x, topk_ids, topk_weights, w13_q.shape[0], mlp)


def fused_moe_fp8_gathered(
    x: torch.Tensor, w13_q: torch.Tensor, w13_scale: torch.Tensor, w2_q: torch.Tensor, w2_scale: torch.Tensor,
    block: Block, topk_ids: torch.Tensor, topk_weights: torch.Tensor, act: Activation = F.silu,
    input_scales: StaticScales = None,
) -> torch.Tensor:
    """Each routed pair's expert gathered (codes and scales), the dense math pair by pair."""
    _check(w13_q, w13_scale, w2_q, w2_scale, block, input_scales)

    def mlp(rows: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        a13, a2 = expert_scales(input_scales, e)
        h = gated(_dense_linear(rows, w13_q[e], w13_scale[e], block, a13), act)
        return _dense_linear(h, w2_q[e], w2_scale[e], block, a2)  # [T * K, 1, H]

    return gathered_by_expert(x, topk_ids, topk_weights, mlp)


def fused_moe_fp8_triton(
    x: torch.Tensor, w13_q: torch.Tensor, w13_scale: torch.Tensor, w2_q: torch.Tensor, w2_scale: torch.Tensor,
    block: Block, topk_ids: torch.Tensor, topk_weights: torch.Tensor, act: Activation = F.silu,
    input_scales: StaticScales = None,
) -> torch.Tensor:
    """Two grouped FP8 GEMM launches; the activations quantized by the Triton quantizer (with
    static scales each pair's row by its expert's: the first GEMM reads pair rows then)."""
    from batonlm.kernels import _triton_moe

    _check(w13_q, w13_scale, w2_q, w2_scale, block, input_scales)
    pairs, k = topk_ids.numel(), topk_ids.shape[1]

    def mlp(sorted_ids: torch.Tensor, block_expert: torch.Tensor, pair_expert: torch.Tensor) -> torch.Tensor:
        if input_scales is not None:
            a13, a2 = (a[pair_expert][:, None] for a in input_scales)
            rows = x.repeat_interleave(k, dim=0)
            x_q = static_quant_fp8(rows, a13, use_triton=True)
            h = _triton_moe.grouped_gemm_fp8(x_q, a13, w13_q, w13_scale, None, sorted_ids, block_expert, pairs, 1,
                                             x.dtype)
            g = gated(h, act)
            return _triton_moe.grouped_gemm_fp8(static_quant_fp8(g, a2, use_triton=True), a2, w2_q, w2_scale, None,
                                                sorted_ids, block_expert, pairs, 1, x.dtype)
        x_q, x_s = per_token_group_quant_fp8(x, _group(x, block), use_triton=True)
        h = _triton_moe.grouped_gemm_fp8(x_q, x_s, w13_q, w13_scale, block, sorted_ids, block_expert, pairs, k, x.dtype)
        g = gated(h, act)
        g_q, g_s = per_token_group_quant_fp8(g, _group(g, block), use_triton=True)
        return _triton_moe.grouped_gemm_fp8(g_q, g_s, w2_q, w2_scale, block, sorted_ids, block_expert, pairs, 1,
                                            x.dtype)

    return aligned_by_expert(x, topk_ids, topk_weights, w13_q.shape[0], mlp)
