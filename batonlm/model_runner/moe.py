"""The sparse mixture-of-experts layer that takes the place of a decoder layer's MLP.

A router (a linear layer over the hidden state, replicated on every rank) scores the experts;
each token goes through its top-k experts' gated MLPs and their outputs are summed with the
routing weights (`batonlm.kernels.moe`). What families differ in is a `MoEOptions`: Qwen3-MoE
renormalises the top-k probabilities when `norm_topk_prob` and rounds them to the model dtype,
Mixtral always renormalises and keeps them in float32, Qwen2-MoE adds a shared expert every token
goes through, scaled by a sigmoid gate. DeepSeek routes within groups of experts: V2 picks the
`topk_group` groups with the highest expert probability, V3 scores experts with a sigmoid plus a
learned bias (for choosing only) and ranks groups by their two best; both scale the routing
weights by `routed_scaling_factor` and add ungated shared experts.

Tensor parallelism slices every expert's intermediate features over the ranks, as the dense MLP
is sliced: each rank holds all experts, rows of their gate/up and columns of their down
projection, and one all-reduce sums the partial outputs. Whatever the routing, every rank does
the same share of the work (no expert-parallel imbalance, no all-to-all), and DP attention's
gathered MLP (`dp_gathered_mlp`) takes the layer unchanged. Experts are stored fused: `w13`
[E, 2 * I_rank, H] (gate rows then up rows) and `w2` [E, H, I_rank]; the loader fills them from
the checkpoint's per-expert tensors. A shared expert is sliced the same way; its partial output
joins the experts' before the all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.symbolic_shapes import statically_known_true

from batonlm.distributed.group import TPGroup
from batonlm.distributed.layout import split_evenly
from batonlm.kernels import moe as moe_kernels
from batonlm.kernels import moe_fp8, moe_int4, moe_int8
from batonlm.kernels.int4 import STORED_SCALES
from batonlm.model_runner.layers import GatedMLP, activation


@dataclass(frozen=True)
class MoEOptions:
    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    renormalize: bool  # the top-k probabilities divided by their sum
    weights_in_fp32: bool  # routing weights kept in float32 (else rounded to the model dtype)
    # A shared expert every token goes through (0: none), scaled by sigmoid(a linear gate) when
    # `shared_gated` (Qwen2-MoE), added as is otherwise (DeepSeek's `n_shared_experts` as one MLP).
    shared_intermediate_size: int = 0
    shared_gated: bool = True
    scoring: str = "softmax"  # or "sigmoid" (DeepSeek-V3)
    # Group-limited routing: experts in `groups` groups, the top-k taken from the best
    # `topk_group`, ranked by their best expert ("max", V2) or two best summed ("top2", V3).
    groups: int = 1
    topk_group: int = 1
    group_rank: str = "max"
    score_bias: bool = False  # a learned per-expert bias added to the scores for choosing (V3)
    scaling_factor: float = 1.0  # the routing weights' multiplier (routed_scaling_factor)


class FusedExperts(nn.Module):
    """Every expert's gated MLP, this rank's slice of their intermediate features."""

    def __init__(self, hidden: int, opts: MoEOptions, tp: TPGroup) -> None:
        super().__init__()
        self.intermediate = opts.intermediate_size  # the checkpoint's, per expert
        self.rows = split_evenly(opts.intermediate_size, tp.size, tp.rank)  # (start, count) on this rank
        count = self.rows[1]
        self.w13 = nn.Parameter(torch.empty(opts.num_experts, 2 * count, hidden))
        self.w2 = nn.Parameter(torch.empty(opts.num_experts, hidden, count))


class _ScaledExperts(nn.Module):
    """What FP8 and int8 experts share: codes with their scales (`w13_q`, `w13_scale`, `w2_q`,
    `w2_scale`, registered by each), this rank's slice, and each expert's static activation
    scales (gate/up's, down's: float32 [E]) where the checkpoint calibrated them, else None."""

    w13_q: torch.Tensor
    w13_scale: torch.Tensor
    w2_q: torch.Tensor
    w2_scale: torch.Tensor
    w13_input_scale: torch.Tensor | None
    w2_input_scale: torch.Tensor | None

    def __init__(self, experts: FusedExperts, static: bool) -> None:
        super().__init__()
        self.intermediate, self.rows = experts.intermediate, experts.rows
        num = experts.w13.shape[0]
        for name in ("w13_input_scale", "w2_input_scale"):
            self.register_buffer(name, torch.empty(num) if static else None)

    @property
    def input_scales(self) -> moe_kernels.StaticScales:
        a13, a2 = self.w13_input_scale, self.w2_input_scale
        return None if a13 is None or a2 is None else (a13, a2)


class Fp8Experts(_ScaledExperts):
    """Every expert's gated MLP kept in FP8, in blocks (`block`: a W8A8 block checkpoint's
    experts, DeepSeek-V3, Qwen3-MoE FP8) or per output channel (None: FP8_DYNAMIC, online FP8;
    with `static`, each expert's calibrated input scales: AutoFP8's Mixtral-8x7B-FP8),
    this rank's slice of their intermediate features, in place of `FusedExperts`
    (quantization/resident_experts.py swaps it in and fills it). `kernels/moe_fp8.py`, picked
    as for float experts (`_pick`). On the CPU, as `Fp8Linear` there, `finish_load` keeps the
    torch references' float32 weight operands (`w13_f`, `w2_f`), which the CPU formulations
    take in place of the codes: the same outputs, 4 bytes a weight more."""

    w13_f: torch.Tensor | None
    w2_f: torch.Tensor | None

    def __init__(self, experts: FusedExperts, block: tuple[int, int] | None, static: bool = False) -> None:
        super().__init__(experts, static)
        self.block = block
        num, two_count, hidden = experts.w13.shape
        count = two_count // 2
        self.register_buffer("w13_q", torch.empty(num, two_count, hidden, dtype=torch.float8_e4m3fn))
        self.register_buffer("w2_q", torch.empty(num, hidden, count, dtype=torch.float8_e4m3fn))
        if block is None:
            self.register_buffer("w13_scale", torch.empty(num, two_count))
            self.register_buffer("w2_scale", torch.empty(num, hidden))
        else:
            bn, bk = block
            self.register_buffer("w13_scale", torch.empty(num, -(-two_count // bn), -(-hidden // bk)))
            self.register_buffer("w2_scale", torch.empty(num, -(-hidden // bn), -(-count // bk)))
        self.register_buffer("w13_f", None, persistent=False)
        self.register_buffer("w2_f", None, persistent=False)

    def finish_load(self) -> None:
        if self.w13_q.device.type == "cpu":
            self.w13_f = moe_fp8.float_operand(self.w13_q, self.w13_scale, self.block)
            self.w2_f = moe_fp8.float_operand(self.w2_q, self.w2_scale, self.block)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, act: moe_kernels.Activation,
                ) -> torch.Tensor:
        run = _pick(x, ids.shape[1], self.w13_q.shape[0], moe_fp8.fused_moe_fp8_triton, moe_fp8.fused_moe_fp8_gathered,
                    moe_fp8.fused_moe_fp8_dense, moe_fp8.fused_moe_fp8_grouped)
        w13, w2 = (self.w13_f, self.w2_f) if self.w13_f is not None and self.w2_f is not None else (self.w13_q, self.w2_q)
        return run(x, w13, self.w13_scale, w2, self.w2_scale, self.block, ids, weights, act,
                   input_scales=self.input_scales)


class Int8Experts(_ScaledExperts):
    """Every expert's gated MLP kept in int8 per output channel with int8 activations per token
    (W8A8 int8 experts; with `static`, by each expert's calibrated input scales), this rank's
    slice, in place of `FusedExperts` (quantization/resident_experts.py). `kernels/moe_int8.py`,
    picked as for float experts."""

    def __init__(self, experts: FusedExperts, static: bool = False) -> None:
        super().__init__(experts, static)
        num, two_count, hidden = experts.w13.shape
        self.register_buffer("w13_q", torch.empty(num, two_count, hidden, dtype=torch.int8))
        self.register_buffer("w13_scale", torch.empty(num, two_count))
        self.register_buffer("w2_q", torch.empty(num, hidden, two_count // 2, dtype=torch.int8))
        self.register_buffer("w2_scale", torch.empty(num, hidden))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, act: moe_kernels.Activation,
                ) -> torch.Tensor:
        run = _pick(x, ids.shape[1], self.w13_q.shape[0], moe_int8.fused_moe_int8_triton,
                    moe_int8.fused_moe_int8_gathered, moe_int8.fused_moe_int8_dense, moe_int8.fused_moe_int8_grouped)
        return run(x, self.w13_q, self.w13_scale, self.w2_q, self.w2_scale, ids, weights, act,
                   input_scales=self.input_scales)


class Int4Experts(nn.Module):
    """Every expert's gated MLP kept in int4 (GPTQ, AWQ, compressed-tensors W4A16 experts, all
    repacked into `kernels/int4.py`'s layout; `bits` 8: its 8-bit twin, GPTQ 8-bit and
    W8A16 experts; GPTQ's activation order with each expert's
    `g_idx`, `group` 0, of `order_groups` groups for w13 and w2; bitsandbytes 4-bit experts with
    their `codebook` and no zeros), weight-only (NVFP4 W4A4: with `fp4_input`, each expert's
    inputs quantized to FP4 by its own `w13_input_scale` / `w2_input_scale`; MXFP8, W4AFP8,
    W4A8: with `input_quant`, every input quantized so and back (kernels/input_quant.py); NVFP4's float8 group
    scales kept as such with `stored_scales` (MXFP4's exponents too), each expert's per-tensor scale per column in
    `w13_scale_2` / `w2_scale_2`; on the CPU, where NVFP4 W4A4 experts stay packed, `finish_load`
    keeps the reference's weight operands `w13_f`, `w2_f`, as `Fp8Experts` does), this rank's slice of
    their intermediate features, in place of `FusedExperts` (quantization/resident_experts.py).
    `kernels/moe_int4.py`, picked as for float experts."""

    w13_qweight: torch.Tensor
    w13_scales: torch.Tensor
    w13_zeros: torch.Tensor | None
    w2_qweight: torch.Tensor
    w2_scales: torch.Tensor
    w2_zeros: torch.Tensor | None
    w13_g_idx: torch.Tensor | None
    w2_g_idx: torch.Tensor | None
    codebook: torch.Tensor | None
    w13_input_scale: torch.Tensor | None
    w2_input_scale: torch.Tensor | None
    w13_scale_2: torch.Tensor | None
    w2_scale_2: torch.Tensor | None
    w13_f: torch.Tensor | None
    w2_f: torch.Tensor | None

    def __init__(self, experts: FusedExperts, group: int, order_groups: tuple[int, int] = (0, 0),
                 bits: int = 4, codebook: bool = False, fp4_input: str = "", stored_scales: str = "",
                 scale_2_divides: bool = False, input_quant: str = "") -> None:
        super().__init__()
        self.intermediate, self.rows, self.group, self.bits = experts.intermediate, experts.rows, group, bits
        self.input_quant = input_quant
        num, two_count, hidden = experts.w13.shape
        count = two_count // 2
        for (name, k, n), ordered in zip((("w13", hidden, two_count), ("w2", count, hidden)), order_groups):
            groups = ordered if group == 0 else 1 if group == -1 else -(-k // group)
            self.register_buffer(f"{name}_qweight", torch.empty(num, -(-k // (32 // bits)), n, dtype=torch.int32))
            # float32: a checkpoint's half-precision scales exactly (bfloat16 would round fp16's).
            self.register_buffer(f"{name}_scales", torch.empty(num, groups, n, dtype=STORED_SCALES[stored_scales]))
            self.register_buffer(f"{name}_scale_2", torch.empty(num, n) if stored_scales == "float8" else None)
            self.register_buffer(f"{name}_zeros", None if codebook else torch.empty(num, groups, n, dtype=torch.uint8))
            # GPTQ's activation order (group 0): each expert's rows' groups.
            self.register_buffer(f"{name}_g_idx", torch.empty(num, k, dtype=torch.int32) if group == 0 else None)
            # NVFP4 W4A4: each expert's FP4 activation scale, as its format stores it
            self.register_buffer(f"{name}_input_scale", torch.empty(num, dtype=torch.float32) if fp4_input else None)
        self.register_buffer("codebook", torch.empty(1 << bits, dtype=torch.float32) if codebook else None)
        self.hidden, self.count, self.fp4_input, self.scale_2_divides = hidden, count, fp4_input, scale_2_divides
        self.dtype = experts.w13.dtype
        self.register_buffer("w13_f", None, persistent=False)
        self.register_buffer("w2_f", None, persistent=False)

    def _weights(self) -> tuple[moe_int4.Int4Weights, moe_int4.Int4Weights]:
        w13 = moe_int4.Int4Weights(self.w13_qweight, self.w13_scales, self.w13_zeros, self.hidden, self.w13_g_idx,
                                   self.bits, self.codebook, self.w13_input_scale, self.fp4_input, self.w13_scale_2,
                                   self.scale_2_divides, self.w13_f, self.input_quant)
        w2 = moe_int4.Int4Weights(self.w2_qweight, self.w2_scales, self.w2_zeros, self.count, self.w2_g_idx, self.bits,
                                  self.codebook, self.w2_input_scale, self.fp4_input, self.w2_scale_2,
                                  self.scale_2_divides, self.w2_f, self.input_quant)
        return w13, w2

    def finish_load(self) -> None:
        """Once the checkpoint is in: on the CPU, the dequantized weight operands (see the class)."""
        if self.w13_qweight.device.type == "cpu":
            w13, w2 = self._weights()
            self.w13_f = moe_int4.dense_weights(w13, self.group, self.dtype)
            self.w2_f = moe_int4.dense_weights(w2, self.group, self.dtype)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, act: moe_kernels.Activation,
                ) -> torch.Tensor:
        w13, w2 = self._weights()
        run = _pick(x, ids.shape[1], self.w13_qweight.shape[0], moe_int4.fused_moe_int4_triton,
                    moe_int4.fused_moe_int4_gathered, moe_int4.fused_moe_int4_dense, moe_int4.fused_moe_int4_grouped)
        return run(x, w13, w2, self.group, ids, weights, act)


Run = TypeVar("Run")


def _pick(x: torch.Tensor, top_k: int, num_experts: int, triton: Run, gathered: Run, traced: Run, grouped: Run) -> Run:
    """Which formulation of the experts runs: Triton on CUDA; in a traced graph (the CPU's
    compiled step) the gathered one for a batch of one token (its K routed expert copies fewer
    than the experts: the batch-1 graph), else `traced` (the dense one for quantized experts,
    whose int8 / FP8 GEMMs gain from the graph; float experts' grouped op); eager on the CPU the
    grouped one. The batch size is read without a guard (`statically_known_true`): the 2-64 row
    graph's is symbolic, and comparing it would fix the graph to the size it was traced with."""
    if x.is_cuda:
        return triton
    if torch.compiler.is_compiling():
        one = statically_known_true(x.shape[0] == 1)
        return gathered if one and top_k < num_experts else traced
    return grouped


def _formulation(x: torch.Tensor, opts: MoEOptions) -> moe_kernels.MoEFunction:
    """Float experts: a traced graph of several rows calls the grouped formulation as one opaque
    op (each expert over its routed rows, eagerly inside the graph: 1.5-1.7x the dense one, which
    runs every expert over every token; docs/benchmarks.md)."""
    return _pick(x, opts.top_k, opts.num_experts, moe_kernels.fused_moe_triton, moe_kernels.fused_moe_gathered,
                 moe_kernels.fused_moe_grouped_op, moe_kernels.fused_moe_grouped)


class SparseMoE(nn.Module):
    """router -> top-k -> experts -> weighted sum (-> all-reduce over `tp`)."""

    def __init__(self, hidden: int, opts: MoEOptions, act: str, tp: TPGroup) -> None:
        super().__init__()
        self.opts = opts
        self.gate = nn.Linear(hidden, opts.num_experts, bias=False)
        if opts.score_bias:  # the checkpoint's `gate.e_score_correction_bias`
            self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(opts.num_experts))
        self.experts: FusedExperts | Fp8Experts | Int8Experts | Int4Experts = FusedExperts(hidden, opts, tp)
        self.act = activation(act)
        self.tp = tp
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if opts.shared_intermediate_size:
            start, count = split_evenly(opts.shared_intermediate_size, tp.size, tp.rank)
            # Its down projection's partial sum joins the experts' in the layer's one all-reduce.
            self.shared_expert = GatedMLP(hidden, count, act, checkpoint_rows=(start, opts.shared_intermediate_size))
            if opts.shared_gated:
                self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_ids, topk_weights) [T, K], as transformers' routers compute them."""
        opts = self.opts
        logits = self.gate(x)
        if opts.scoring == "sigmoid":
            scores = torch.sigmoid(logits.to(torch.float32))
        else:
            scores = F.softmax(logits, dim=-1, dtype=torch.float32)
        if opts.groups == 1 and not opts.score_bias:
            weights, ids = torch.topk(scores, opts.top_k, dim=-1)
        else:
            ids = torch.topk(self._choice_scores(scores), opts.top_k, dim=-1)[1]
            weights = scores.gather(1, ids)
        if opts.renormalize:
            total = weights.sum(dim=-1, keepdim=True)
            weights = weights / (total + 1e-20 if opts.scoring == "sigmoid" else total)
        if opts.scaling_factor != 1.0:
            weights = weights * opts.scaling_factor
        return ids, weights if opts.weights_in_fp32 else weights.to(x.dtype)

    def _choice_scores(self, scores: torch.Tensor) -> torch.Tensor:
        """The scores the top-k is chosen by: biased (V3), and outside the best `topk_group`
        groups pushed below every score inside them."""
        opts = self.opts
        if opts.score_bias:
            bias = self.gate.e_score_correction_bias
            assert isinstance(bias, torch.Tensor)
            scores = scores + bias
        if opts.groups == 1:
            return scores
        grouped = scores.view(-1, opts.groups, opts.num_experts // opts.groups)
        rank = grouped.max(dim=-1).values if opts.group_rank == "max" else grouped.topk(2, dim=-1)[0].sum(dim=-1)
        best = torch.topk(rank, opts.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(rank, dtype=torch.bool).scatter_(1, best, True)
        keep = keep[:, :, None].expand_as(grouped).reshape(scores.shape)
        # Softmax scores are positive: 0 ranks below them (V2); biased sigmoid ones need -inf.
        return scores.masked_fill(~keep, 0.0 if opts.scoring == "softmax" else float("-inf"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        experts = self.experts
        if isinstance(experts, (Fp8Experts, Int8Experts, Int4Experts)):
            out = experts(x, ids, weights, self.act)
        else:
            out = _formulation(x, self.opts)(x, experts.w13, experts.w2, ids, weights, self.act)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            gate = self.shared_expert_gate
            out = out + (shared if gate is None else torch.sigmoid(gate(x)) * shared)
        return out if self.tp.size == 1 else self.tp.all_reduce(out)
