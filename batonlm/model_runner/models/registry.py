"""Model families, keyed by the `architectures` entry of a Hugging Face config."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DecoderOptions:
    """What distinguishes one Llama-like family from another."""

    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False


@dataclass(frozen=True)
class ModelFamily:
    name: str
    architectures: tuple[str, ...]
    options: Callable[[dict[str, Any]], DecoderOptions]


MODEL_FAMILIES: dict[str, ModelFamily] = {}


def register_family(family: ModelFamily) -> ModelFamily:
    for arch in family.architectures:
        MODEL_FAMILIES[arch] = family
    return family


def family_for(architecture: str) -> ModelFamily:
    try:
        return MODEL_FAMILIES[architecture]
    except KeyError:
        raise ValueError(
            f"model architecture {architecture!r} is not supported (supported: {', '.join(sorted(MODEL_FAMILIES))})"
        ) from None


register_family(
    ModelFamily(
        "llama",
        ("LlamaForCausalLM",),
        lambda c: DecoderOptions(
            qkv_bias=bool(c.get("attention_bias", False)),
            o_bias=bool(c.get("attention_bias", False)),
            mlp_bias=bool(c.get("mlp_bias", False)),
        ),
    )
)
register_family(ModelFamily("mistral", ("MistralForCausalLM",), lambda c: DecoderOptions()))
register_family(ModelFamily("qwen2", ("Qwen2ForCausalLM",), lambda c: DecoderOptions(qkv_bias=True)))
register_family(
    ModelFamily(
        "qwen3",
        ("Qwen3ForCausalLM",),
        lambda c: DecoderOptions(
            qkv_bias=bool(c.get("attention_bias", False)),
            o_bias=bool(c.get("attention_bias", False)),
            qk_norm=True,
        ),
    )
)
