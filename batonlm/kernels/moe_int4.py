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
is codebook[q] * scale, and there are no zeros.

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
    or no zeros and a `codebook` [2^bits], each code's value."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    k: int  # input features
    g_idx: torch.Tensor | None = None
    bits: int = 4
    codebook: torch.Tensor | None = None

    def expert(self, e: int | torch.Tensor) -> Int4Weights:
        """Expert e's weights (a tensor of experts: those experts', gathered)."""
        return Int4Weights(self.qweight[e], self.scales[e], None if self.zeros is None else self.zeros[e], self.k,
                           None if self.g_idx is None else self.g_idx[e], self.bits, self.codebook)

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


def fused_moe_int4_grouped(
    x: torch.Tensor, w13: Int4Weights, w2: Int4Weights, group: int, topk_ids: torch.Tensor,
    topk_weights: torch.Tensor, act: Activation = F.silu,
) -> torch.Tensor:
    w13.check("w13", group)
    w2.check("w2", group)

    def linear(x: torch.Tensor, w: Int4Weights) -> torch.Tensor:
        return int4_dequant_matmul_reference(x, w.qweight, w.scales, w.zeros, group, None, w.g_idx, w.bits, w.codebook)

    def mlp(e: int, seg: torch.Tensor) -> torch.Tensor:
        return linear(gated(linear(seg, w13.expert(e)), act), w2.expert(e))

    return grouped_by_expert(x, topk_ids, topk_weights, w13.qweight.shape[0], w2.qweight.shape[2], mlp)


def _dense_weights(w: Int4Weights, group: int, dtype: torch.dtype) -> torch.Tensor:
    """[E, N, K] in `dtype`: each expert's weight as the reference rounds it."""
    experts = [w.expert(e) for e in range(w.qweight.shape[0])]
    return torch.stack([dequantize_int4(x.qweight, x.scales, x.zeros, group, w.k, dtype, x.g_idx, w.bits, w.codebook)
                        for x in experts])


def fused_moe_int4_dense(
    x: torch.Tensor, w13: Int4Weights, w2: Int4Weights, group: int, topk_ids: torch.Tensor,
    topk_weights: torch.Tensor, act: Activation = F.silu,
) -> torch.Tensor:
    w13.check("w13", group)
    w2.check("w2", group)

    def mlp(x: torch.Tensor) -> torch.Tensor:
        h = gated(torch.matmul(x.unsqueeze(0), _dense_weights(w13, group, x.dtype).transpose(1, 2)), act)  # [E, T, I]
        return torch.matmul(h, _dense_weights(w2, group, x.dtype).transpose(1, 2))  # [E, T, H]

    return dense_by_expert(x, topk_ids, topk_weights, w13.qweight.shape[0], mlp)


def fused_moe_int4_gathered(
    x: torch.Tensor, w13: Int4Weights, w2: Int4Weights, group: int, topk_ids: torch.Tensor,
    topk_weights: torch.Tensor, act: Activation = F.silu,
) -> torch.Tensor:
    """Each routed pair's expert gathered and dequantized, one batched matmul."""
    w13.check("w13", group)
    w2.check("w2", group)

    def mlp(rows: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        h = gated(torch.matmul(rows, _dense_weights(w13.expert(e), group, x.dtype).transpose(1, 2)), act)
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

    def mlp(sorted_ids: torch.Tensor, block_expert: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
        h = _triton_moe_int4.grouped_gemm_int4(x, w13, group, sorted_ids, block_expert, pairs, k)
        return _triton_moe_int4.grouped_gemm_int4(gated(h, act), w2, group, sorted_ids, block_expert, pairs, 1)

    return aligned_by_expert(x, topk_ids, topk_weights, w13.qweight.shape[0], mlp)
