"""DeepSeek-V2 and DeepSeek-V3: the decoder of `decoder.py` with multi-head latent attention
(`mla.py`), dense MLPs in the first `first_k_dense_replace` layers and group-routed mixtures of
experts with ungated shared experts after them (`moe.py`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from batonlm.model_runner.model_config import ModelConfigError
from batonlm.model_runner.models.decoder import DecoderLM, DecoderOptions
from batonlm.model_runner.models.families import moe_field
from batonlm.model_runner.moe import MoEOptions
from batonlm.model_runner.weight_loader import Target


def _deepseek_moe(raw: dict[str, Any], **routing: Any) -> DecoderOptions:
    experts = moe_field(raw, "n_routed_experts", "num_local_experts")
    groups = int(raw.get("n_group") or 1)
    if experts % groups:
        raise ModelConfigError(f"config.json: {experts} routed experts do not split into n_group={groups} groups")
    moe = MoEOptions(
        num_experts=experts,
        top_k=moe_field(raw, "num_experts_per_tok"),
        intermediate_size=moe_field(raw, "moe_intermediate_size"),
        weights_in_fp32=True,
        shared_intermediate_size=int(raw.get("n_shared_experts") or 0) * int(raw["moe_intermediate_size"]),
        shared_gated=False,
        groups=groups,
        topk_group=int(raw.get("topk_group") or 1),
        scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
        **routing,
    )
    bias = bool(raw.get("attention_bias", False))
    first_dense = int(raw.get("first_k_dense_replace") or 0)
    layers = frozenset(range(first_dense, int(raw["num_hidden_layers"])))
    return DecoderOptions(o_bias=bias, moe=moe, moe_layers=layers)


class _DeepseekLM(DecoderLM):
    # The routed experts are `experts.<e>.{gate,up,down}_proj`, the shared ones one MLP.
    checkpoint_renames = ((".shared_expert.", ".shared_experts."),)

    def weight_target(self, param_name: str, name: str, p: torch.Tensor) -> Target | None:
        """MLA's per-head projections split by query head: rows of q_proj / q_b_proj and
        kv_b_proj, columns of o_proj; the latent projections are whole on every rank."""
        if ".self_attn." not in name:
            return None
        mla, heads, total = self.config.mla, self.shard.heads, self.config.num_heads
        assert mla is not None
        first = self.shard.rank * heads
        leaf = ".".join(name.split(".")[-2:])
        size = {"q_proj.weight": mla.qk_head_dim, "q_b_proj.weight": mla.qk_head_dim,
                "kv_b_proj.weight": mla.qk_nope_head_dim + mla.v_head_dim}.get(leaf)
        if size is not None:  # rows: each head's features
            return Target(p, 0, heads * size, 0, first * size, total * size)
        if leaf == "o_proj.weight":  # columns: each head's values
            return Target(p, 0, p.shape[1], 1, first * mla.v_head_dim, total * mla.v_head_dim)
        return None


class DeepseekV2ForCausalLM(_DeepseekLM):
    """Softmax routing; `topk_method` greedy, or group_limited_greedy (the best `topk_group`
    groups by their best expert); weights scaled, never renormalised (as transformers')."""

    @classmethod
    def options(cls, raw: dict[str, Any]) -> DecoderOptions:
        method = raw.get("topk_method") or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise ModelConfigError(f"config.json: DeepSeek-V2 topk_method {method!r} is not supported "
                                   "(greedy, group_limited_greedy)")
        opts = _deepseek_moe(raw, renormalize=False, group_rank="max")
        if method == "greedy":
            assert opts.moe is not None
            opts = replace(opts, moe=replace(opts.moe, groups=1, topk_group=1))
        return opts


class DeepseekV3ForCausalLM(_DeepseekLM):
    """Sigmoid scores plus a learned bias for choosing, groups ranked by their two best experts,
    the chosen scores renormalised when `norm_topk_prob`, then scaled."""

    @classmethod
    def options(cls, raw: dict[str, Any]) -> DecoderOptions:
        return _deepseek_moe(raw, renormalize=bool(raw.get("norm_topk_prob", True)), scoring="sigmoid",
                             group_rank="top2", score_bias=True)
