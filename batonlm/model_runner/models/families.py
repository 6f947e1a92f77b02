"""The Llama-like families, dense and mixture-of-experts: the decoder of `decoder.py`, each with
its options read from its Hugging Face config. A class per architecture, named after it and registered under that name in
`batonlm.registries.MODEL_ARCHITECTURES`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from batonlm.model_runner.layers import GatedMLP
from batonlm.model_runner.model_config import ModelConfigError
from batonlm.model_runner.models.decoder import DecoderLM, DecoderOptions
from batonlm.model_runner.moe import MoEOptions
from batonlm.model_runner.weight_loader import Target


class LlamaForCausalLM(DecoderLM):
    @classmethod
    def options(cls, raw: dict[str, Any]) -> DecoderOptions:
        bias = bool(raw.get("attention_bias", False))
        return DecoderOptions(qkv_bias=bias, o_bias=bias, mlp_bias=bool(raw.get("mlp_bias", False)))


class MistralForCausalLM(DecoderLM):
    """Llama's layers; its sliding window is a config fact (`ModelConfig.sliding_windows`)."""


class Qwen2ForCausalLM(DecoderLM):
    @classmethod
    def options(cls, raw: dict[str, Any]) -> DecoderOptions:
        return DecoderOptions(qkv_bias=True)


class Qwen3ForCausalLM(DecoderLM):
    @classmethod
    def options(cls, raw: dict[str, Any]) -> DecoderOptions:
        bias = bool(raw.get("attention_bias", False))
        return DecoderOptions(qkv_bias=bias, o_bias=bias, qk_norm=True)


def moe_field(raw: dict[str, Any], *keys: str) -> int:
    """The first of `keys` the config has (checkpoints name the expert count either way:
    transformers 5 writes `num_local_experts` for every family), a positive integer."""
    value = next((raw[k] for k in keys if raw.get(k) is not None), None)
    if not isinstance(value, int) or value < 1:
        raise ModelConfigError(
            f"config.json: a mixture-of-experts model needs {' or '.join(map(repr, keys))} (a positive integer), "
            f"got {value!r}"
        )
    return value


def _qwen_moe(raw: dict[str, Any], attention: DecoderOptions, shared: int = 0) -> DecoderOptions:
    """Qwen's MoE layout: sparse layers every `decoder_sparse_step` layers except
    `mlp_only_layers` (dense MLPs of `intermediate_size`)."""
    moe = MoEOptions(
        num_experts=moe_field(raw, "num_experts", "num_local_experts"),
        top_k=moe_field(raw, "num_experts_per_tok"),
        intermediate_size=moe_field(raw, "moe_intermediate_size"),
        renormalize=bool(raw.get("norm_topk_prob", False)),
        weights_in_fp32=False,
        shared_intermediate_size=shared,
    )
    step = int(raw.get("decoder_sparse_step") or 1)
    dense = set(raw.get("mlp_only_layers") or [])
    layers = frozenset(i for i in range(int(raw["num_hidden_layers"])) if i not in dense and (i + 1) % step == 0)
    return replace(attention, moe=moe, moe_layers=layers)


class Qwen3MoeForCausalLM(DecoderLM):
    """Qwen3's attention; Qwen's MoE layout."""

    @classmethod
    def options(cls, raw: dict[str, Any]) -> DecoderOptions:
        return _qwen_moe(raw, Qwen3ForCausalLM.options(raw))


class Qwen2MoeForCausalLM(DecoderLM):
    """Qwen2's attention (q/k/v bias); Qwen's MoE layout with a gated shared expert."""

    @classmethod
    def options(cls, raw: dict[str, Any]) -> DecoderOptions:
        attention = DecoderOptions(qkv_bias=bool(raw.get("qkv_bias", True)))
        return _qwen_moe(raw, attention, shared=moe_field(raw, "shared_expert_intermediate_size"))


class MixtralForCausalLM(DecoderLM):
    """Mistral's attention; every layer's MLP a sparse MoE (`block_sparse_moe`, experts' w1 / w3
    / w2 the gate / up / down projections), top-k probabilities always renormalised."""

    expert_weight_names = ("w1", "w3", "w2")
    checkpoint_renames = ((".mlp.", ".block_sparse_moe."),)

    @classmethod
    def options(cls, raw: dict[str, Any]) -> DecoderOptions:
        moe = MoEOptions(
            num_experts=moe_field(raw, "num_local_experts", "num_experts"),
            top_k=moe_field(raw, "num_experts_per_tok"),
            intermediate_size=moe_field(raw, "intermediate_size"),
            renormalize=True,
            weights_in_fp32=True,
        )
        return DecoderOptions(moe=moe, moe_layers=frozenset(range(int(raw["num_hidden_layers"]))))


class Phi3ForCausalLM(DecoderLM):
    """Llama's layers, checkpoints with q/k/v fused (`qkv_proj`) and gate/up fused
    (`gate_up_proj`) as batonlm holds them; LongRoPE and partial rotary (`rope_config.py`), a
    sliding window on every layer when the config has one."""

    def weight_target(self, param_name: str, name: str, p: torch.Tensor) -> list[Target] | None:
        """The fused checkpoint tensors: this rank's rows of each of their parts."""
        if name.endswith("self_attn.qkv_proj.weight"):
            cfg, shard = self.config, self.shard
            q_full, kv_full = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            (q_start, q_count), (kv_start, kv_count) = shard.q_rows(), shard.kv_rows()
            full = q_full + 2 * kv_full
            return [Target(p, 0, q_count, 0, q_start, full),
                    Target(p, q_count, kv_count, 0, q_full + kv_start, full),
                    Target(p, q_count + kv_count, kv_count, 0, q_full + kv_full + kv_start, full)]
        if name.endswith("mlp.gate_up_proj.weight"):
            mlp = self.get_submodule(param_name.rsplit(".", 2)[0])
            assert isinstance(mlp, GatedMLP)
            (start, full), count = mlp.checkpoint_rows, mlp.intermediate
            return [Target(p, 0, count, 0, start, 2 * full), Target(p, count, count, 0, full + start, 2 * full)]
        return None
