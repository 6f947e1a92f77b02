"""What distinguishes one Llama-like family from another, read from its Hugging Face config.

Each function is registered by architecture name in `batonlm.registries.MODEL_ARCHITECTURES`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DecoderOptions:
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False


def llama(raw: dict[str, Any]) -> DecoderOptions:
    bias = bool(raw.get("attention_bias", False))
    return DecoderOptions(qkv_bias=bias, o_bias=bias, mlp_bias=bool(raw.get("mlp_bias", False)))


def mistral(raw: dict[str, Any]) -> DecoderOptions:
    return DecoderOptions()


def qwen2(raw: dict[str, Any]) -> DecoderOptions:
    return DecoderOptions(qkv_bias=True)


def qwen3(raw: dict[str, Any]) -> DecoderOptions:
    bias = bool(raw.get("attention_bias", False))
    return DecoderOptions(qkv_bias=bias, o_bias=bias, qk_norm=True)
