"""The sparse mixture-of-experts layer that takes the place of a decoder layer's MLP.

A router (a linear layer over the hidden state, replicated on every rank) scores the experts;
each token goes through its top-k experts' gated MLPs and their outputs are summed with the
routing weights (`batonlm.kernels.moe`). What families differ in is a `MoEOptions`: Qwen3-MoE
renormalises the top-k probabilities when `norm_topk_prob` and rounds them to the model dtype,
Mixtral always renormalises and keeps them in float32, Qwen2-MoE adds a shared expert every token
goes through, scaled by a sigmoid gate.

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

import torch
import torch.nn.functional as F
from torch import nn

from batonlm.distributed.group import TPGroup
from batonlm.distributed.layout import split_evenly
from batonlm.kernels import moe as moe_kernels
from batonlm.model_runner.layers import GatedMLP, activation


@dataclass(frozen=True)
class MoEOptions:
    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    renormalize: bool  # the top-k probabilities divided by their sum
    weights_in_fp32: bool  # routing weights kept in float32 (else rounded to the model dtype)
    # A shared expert every token goes through, scaled by sigmoid(a linear gate) (Qwen2-MoE); 0: none.
    shared_intermediate_size: int = 0


class FusedExperts(nn.Module):
    """Every expert's gated MLP, this rank's slice of their intermediate features."""

    def __init__(self, hidden: int, opts: MoEOptions, tp: TPGroup) -> None:
        super().__init__()
        self.intermediate = opts.intermediate_size  # the checkpoint's, per expert
        self.rows = split_evenly(opts.intermediate_size, tp.size, tp.rank)  # (start, count) on this rank
        count = self.rows[1]
        self.w13 = nn.Parameter(torch.empty(opts.num_experts, 2 * count, hidden))
        self.w2 = nn.Parameter(torch.empty(opts.num_experts, hidden, count))


def _formulation(x: torch.Tensor) -> moe_kernels.MoEFunction:
    if x.is_cuda:
        return moe_kernels.fused_moe_triton
    if torch.compiler.is_compiling():
        return moe_kernels.fused_moe_dense
    return moe_kernels.fused_moe_grouped


class SparseMoE(nn.Module):
    """router -> top-k -> experts -> weighted sum (-> all-reduce over `tp`)."""

    def __init__(self, hidden: int, opts: MoEOptions, act: str, tp: TPGroup) -> None:
        super().__init__()
        self.opts = opts
        self.gate = nn.Linear(hidden, opts.num_experts, bias=False)
        self.experts = FusedExperts(hidden, opts, tp)
        self.act = activation(act)
        self.tp = tp
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if opts.shared_intermediate_size:
            start, count = split_evenly(opts.shared_intermediate_size, tp.size, tp.rank)
            # Its down projection's partial sum joins the experts' in the layer's one all-reduce.
            self.shared_expert = GatedMLP(hidden, count, act, checkpoint_rows=(start, opts.shared_intermediate_size))
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_ids, topk_weights) [T, K], as transformers' routers compute them."""
        logits = self.gate(x)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.opts.top_k, dim=-1)
        if self.opts.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights if self.opts.weights_in_fp32 else weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        out = _formulation(x)(x, self.experts.w13, self.experts.w2, ids, weights, self.act)
        if self.shared_expert is not None:
            assert self.shared_expert_gate is not None
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out if self.tp.size == 1 else self.tp.all_reduce(out)
