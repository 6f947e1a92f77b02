"""The Llama-like families: the decoder of `decoder.py`, each with its options read from its
Hugging Face config. A class per architecture, named after it and registered under that name in
`batonlm.registries.MODEL_ARCHITECTURES`.
"""

from __future__ import annotations

from typing import Any

from batonlm.model_runner.models.decoder import DecoderLM, DecoderOptions


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
