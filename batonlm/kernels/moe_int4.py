"""Mixture-of-experts with every expert's weights in int4 (GPTQ, AWQ, compressed-tensors W4A16
MoE checkpoints: Qwen3-MoE, Mixtral, DeepSeek in 4 bits): each expert's gated MLP is
`PackedIntLinear`'s math twice, weight-only. Each weight is dequantized exactly ((q - zero) * scale,
in float32) and rounded once to the activation dtype, then multiplied in that dtype
(`int4_dequant_matmul`); the routed outputs are summed as `batonlm.kernels.moe` sums them.

Weights, one `batonlm.kernels.int4` layout per expert (W^T packed along its input rows;
or its 8-bit twin, `bits` 8: GPTQ 8-bit and W8A16 experts, 4 codes per word instead of 8):
`w13_qweight` int32 [E, ceil(H / 8), 2I] (gate columns then up columns), `w13_scales` float32
and `w13_zeros` uint8 [E, ceil(H / G), 2I]; `w2_qweight` [E, ceil(I / 8), H], `w2_scales` /
`w2_zeros` [E, ceil(I / G), H]. One group size G for both (-1: one group of all rows); or GPTQ's
activation order (G = 0): each expert's `g_idx` [E, K], its rows' groups of any number. With a
`codebook` (bitsandbytes 4-bit experts: NF4 / FP4, float32 [16], one for every expert) a weight
is codebook[q] * scale, and there are no zeros; NVFP4's float8 scales with `scale_2` [E, N], each
expert's per-tensor scale per column, multiplying them or (`scale_2_divides`) dividing them
(`kernels/int4.py`). NVFP4 W4A4 experts also quantize each expert's
input to FP4 with that expert's own scale (`input_scale` [E], `fp4_input`: the format whose
arithmetic, kernels/fp4.py): every formulation quantizes each routed row by its expert's before
the gate/up product, and the gated product before the down product. MXFP8, W4AFP8 and W4A8
experts (`input_quant`) quantize the same two inputs so and back (kernels/input_quant.py), each
row by itself.

Four formulations, as for float experts:
- `fused_moe_int4_grouped`: one expert at a time over its rows, through the torch reference (the
  reference, and the CPU's eager path);
- `fused_moe_int4_dense`: every expert over every token, weighted by exact zeros where not routed
  (the CPU's compiled step); the same rounded weights, so each routed row's products are the
  grouped path's;
- `fused_moe_int4_gathered`: the dense math over each routed pair's gathered expert (the
  compiled step's batch-1 graph);
- `fused_moe_int4_triton` (CUDA): two grouped GEMM launches dequantizing each weight tile as it
  is loaded (`_triton_moe_int4.py`), every shape fixed by the batch size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batonlm.kernels.fp4 import FP4_INPUTS
from batonlm.kernels.input_quant import INPUT_QUANTS
from batonlm.kernels.int4 import dequantize_int4, int4_dequant_matmul_reference
from batonlm.kernels.moe import (
    Activation,
    aligned_by_expert,
    dense_by_expert,
    gated,
    gathered_by_expert,
    grouped_by_expert,
)


@dataclass(frozen=True)
class Int4Weights:
    """One projection of every expert: qweight [E, ceil(K / (32 / bits)), N], scales and zeros
    [E, G, N]; in GPTQ's activation order (group 0) `g_idx` [E, K], each expert's rows' groups;
    or no zeros and a `codebook` [2^bits], each code's value; with `input_scale` [E] (float32)
    each expert's input quantized to FP4 first, in the arithmetic `fp4_input` names."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    k: int  # input features
    g_idx: torch.Tensor | None = None
    bits: int = 4
    codebook: torch.Tensor | None = None
    input_scale: torch.Tensor | None = None
    fp4_input: str = ""
    scale_2: torch.Tensor | None = None
    scale_2_divides: bool = False
    dense: torch.Tensor | None = None  # [E, N, K]: the weights the codes mean, kept (the CPU's operand)
    input_quant: str = ""  # every row quantized and back first (a key of kernels/input_quant.INPUT_QUANTS)

    def expert(self, e: int | torch.Tensor) -> Int4Weights:
        """Expert e's weights (a tensor of experts: those experts', gathered)."""
        return Int4Weights(self.qweight[e], self.scales[e], None if self.zeros is None else self.zeros[e], self.k,
                           None if self.g_idx is None else self.g_idx[e], self.bits, self.codebook,
                           None if self.input_scale is None else self.input_scale[e], self.fp4_input,
                           None if self.scale_2 is None else self.scale_2[e], self.scale_2_divides,
                           None if self.dense is None else self.dense[e], self.input_quant)

    def quantized_input(self, rows: torch.Tensor, experts: torch.Tensor | None = None) -> torch.Tensor:
        """rows [M, K] as this projection takes them: unchanged, quantized to FP4 by the scale of
        each row's expert (`experts` [M]; None: one expert's, this one's scalar), or as `input_quant` says
        (no scale: each row's groups their own)."""
        if self.input_quant:
            return INPUT_QUANTS[self.input_quant](rows)
        if self.input_scale is None:
            return rows
        scale = self.input_scale if experts is None else self.input_scale[experts]
        return FP4_INPUTS[self.fp4_input](rows, scale)

    def check(self, name: str, group: int) -> None:
        e, packed, n = self.qweight.shape
        if (group == 0) != (self.g_idx is not None) or (
                self.g_idx is not None and tuple(self.g_idx.shape) != (e, self.k)):
            raise ValueError(f"{name}_g_idx: expected [{e}, {self.k}] exactly when the group is 0 (activation "
                             f"order), got {None if self.g_idx is None else list(self.g_idx.shape)} for group {group}")
        groups = self.scales.shape[1] if group == 0 else 1 if group == -1 else -(-self.k // group)
        rows = -(-self.k // (32 // self.bits)) if self.bits in (4, 8) else -1
        if self.qweight.dtype != torch.int32 or packed != rows:
            raise ValueError(f"{name}_qweight: expected int32 [{e}, {rows}, N] ({self.bits} bits), got "
                             f"{self.qweight.dtype} {list(self.qweight.shape)}")
        if (self.zeros is None) == (self.codebook is None):
            raise ValueError(f"{name}_zeros: expected zeros exactly when there is no codebook, got "
                             f"{'neither' if self.zeros is None else 'both'}")
        if self.codebook is not None and (self.codebook.dtype != torch.float32 or
                                          tuple(self.codebook.shape) != (1 << self.bits,)):
            raise ValueError(f"{name}_codebook: expected float32 [{1 << self.bits}], got {self.codebook.dtype} "
                             f"{list(self.codebook.shape)}")
        for what, t in (("scales", self.scales), ("zeros", self.zeros)):
            if t is not None and tuple(t.shape) != (e, groups, n):
                raise ValueError(f"{name}_{what}: expected [{e}, {groups}, {n}], got {list(t.shape)}")
        if self.scale_2 is not None and (self.scale_2.dtype != torch.float32 or tuple(self.scale_2.shape) != (e, n)):
            raise ValueError(f"{name}_scale_2: expected float32 [{e}, {n}], got {self.scale_2.dtype} "
                             f"{list(self.scale_2.shape)}")
        if self.input_scale is not None and (self.fp4_input not in FP4_INPUTS or self.input_scale.dtype != torch.float32
                                             or tuple(self.input_scale.shape) != (e,)):
            raise ValueError(f"{name}_input_scale: expected float32 [{e}] with fp4_input one of "
                             f"{', '.join(FP4_INPUTS)}, got {self.input_scale.dtype} {list(self.input_scale.shape)} "
                             f"with {self.fp4_input!r}")


def fused_moe_int4_grouped(
    x: torch.Tensor, w13: Int4Weights, w2: Int4Weights, group: int, topk_ids: torch.Tensor,
    topk_weights: torch.Tensor, act: Activation = F.silu,
) -> torch.Tensor:
    w13.check("w13", group)
    w2.check("w2", group)

    def linear(x: torch.Tensor, w: Int4Weights) -> torch.Tensor:  # (one expert's: its scalar input scale)
        if w.dense is not None and w.dense.dtype == x.dtype:  # the reference's operand, kept
            return F.linear(w.quantized_input(x), w.dense)
        return int4_dequant_matmul_reference(w.quantized_input(x), w.qweight, w.scales, w.zeros, group, None, w.g_idx,
                                             w.bits, w.codebook, w.scale_2, w.scale_2_divides)

    def mlp(e: int, seg: torch.Tensor) -> torch.Tensor:
        return linear(gated(linear(seg, w13.expert(e)), act), w2.expert(e))

    return grouped_by_expert(x, topk_ids, topk_weights, w13.qweight.shape[0], w2.qweight.shape[2], mlp)


def _dense_weights(w: Int4Weights, group: int, dtype: torch.dtype) -> torch.Tensor:
    """[E, N, K] in `dtype`: each expert's weight as the reference rounds it (kept, or computed)."""
    if w.dense is not None and w.dense.dtype == dtype:
        return w.dense
    return dense_weights(w, group, dtype)


def dense_weights(w: Int4Weights, group: int, dtype: torch.dtype) -> torch.Tensor:
    """[E, N, K] in `dtype`: each expert's weight dequantized as the reference rounds it."""
    experts = [w.expert(e) for e in range(w.qweight.shape[0])]
    return torch.stack([dequantize_int4(x.qweight, x.scales, x.zeros, group, w.k, dtype, x.g_idx, w.bits, w.codebook,
                                        x.scale_2, w.scale_2_divides) for x in experts])


def fused_moe_int4_dense(
    x: torch.Tensor, w13: Int4Weights, w2: Int4Weights, group: int, topk_ids: torch.Tensor,
    topk_weights: torch.Tensor, act: Activation = F.silu,
) -> torch.Tensor:
    w13.check("w13", group)
    w2.check("w2", group)

    experts = w13.qweight.shape[0]

    def per_expert(rows: torch.Tensor, w: Int4Weights) -> torch.Tensor:
        """rows [E, T, K] (every expert's copy of every token) each quantized by its expert's scale."""
        if w.input_quant:  # (no expert's scale: one quantization of every copy)
            return w.quantized_input(rows.reshape(-1, rows.shape[2])).view(rows.shape)
        if w.input_scale is None:
            return rows
        flat_experts = torch.arange(experts, device=rows.device).repeat_interleave(rows.shape[1])
        return w.quantized_input(rows.reshape(-1, rows.shape[2]), flat_experts).view(rows.shape)

    def mlp(x: torch.Tensor) -> torch.Tensor:
        xs = per_expert(x.unsqueeze(0).expand(experts, *x.shape), w13)
        h = gated(torch.matmul(xs, _dense_weights(w13, group, x.dtype).transpose(1, 2)), act)  # [E, T, I]
        return torch.matmul(per_expert(h, w2), _dense_weights(w2, group, x.dtype).transpose(1, 2))  # [E, T, H]

    return dense_by_expert(x, topk_ids, topk_weights, w13.qweight.shape[0], mlp)


def fused_moe_int4_gathered(
    x: torch.Tensor, w13: Int4Weights, w2: Int4Weights, group: int, topk_ids: torch.Tensor,
    topk_weights: torch.Tensor, act: Activation = F.silu,
) -> torch.Tensor:
    """Each routed pair's expert gathered and dequantized, one batched matmul."""
    w13.check("w13", group)
    w2.check("w2", group)

    def mlp(rows: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        rows = w13.quantized_input(rows.squeeze(1), e).unsqueeze(1)
        h = gated(torch.matmul(rows, _dense_weights(w13.expert(e), group, x.dtype).transpose(1, 2)), act)
        h = w2.quantized_input(h.squeeze(1), e).unsqueeze(1)
        return torch.matmul(h, _dense_weights(w2.expert(e), group, x.dtype).transpose(1, 2))  # [T * K, 1, H]

    return gathered_by_expert(x, topk_ids, topk_weights, mlp)


def fused_moe_int4_triton(
    x: torch.Tensor, w13: Int4Weights, w2: Int4Weights, group: int, topk_ids: torch.Tensor,
    topk_weights: torch.Tensor, act: Activation = F.silu,
) -> torch.Tensor:
    from batonlm.kernels import _triton_moe_int4

    w13.check("w13", group)
    w2.check("w2", group)
    pairs, k = topk_ids.numel(), topk_ids.shape[1]

    def mlp(sorted_ids: torch.Tensor, block_expert: torch.Tensor, pair_expert: torch.Tensor) -> torch.Tensor:
        if w13.input_scale is None:  # (input_quant: each token quantized once, whichever its experts)
            h = _triton_moe_int4.grouped_gemm_int4(w13.quantized_input(x), w13, group, sorted_ids, block_expert, pairs,
                                                   k)
        else:  # each pair's row quantized by its expert's scale
            rows = w13.quantized_input(x.repeat_interleave(k, dim=0), pair_expert)
            h = _triton_moe_int4.grouped_gemm_int4(rows, w13, group, sorted_ids, block_expert, pairs, 1)
        h = w2.quantized_input(gated(h, act), None if w2.input_scale is None else pair_expert)
        return _triton_moe_int4.grouped_gemm_int4(h, w2, group, sorted_ids, block_expert, pairs, 1)

    return aligned_by_expert(x, topk_ids, topk_weights, w13.qweight.shape[0], mlp)
