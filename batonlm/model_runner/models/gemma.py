"""Gemma 2 and Gemma 3 (text): the decoder of `decoder.py` with Gemma's options. Norms whose
weight is an offset from 1, around the attention output and the MLP as well as before them;
embeddings times sqrt(hidden); a GeGLU MLP (`hidden_activation`); queries scaled by
`query_pre_attn_scalar` (`ModelConfig.attention_scale`); sliding-window layers interleaved with
global ones (`ModelConfig.sliding_windows`). Gemma 2 soft-caps the attention scores (every
attention backend, `attn_logit_softcapping`) and the final logits; Gemma 3 normalises each query
and key head and turns its sliding layers' rotary at a base of their own (`local_rope`)."""

from __future__ import annotations

from typing import Any

from batonlm.model_runner.models.decoder import DecoderLM, DecoderOptions


def _gemma(raw: dict[str, Any], qk_norm: bool) -> DecoderOptions:
    bias = bool(raw.get("attention_bias", False))
    cap = raw.get("final_logit_softcapping")
    return DecoderOptions(qkv_bias=bias, o_bias=bias, qk_norm=qk_norm, offset_norms=True, sandwich_norms=True,
                          scale_embeddings=True, final_softcap=float(cap) if cap else None)


class Gemma2ForCausalLM(DecoderLM):
    @classmethod
    def options(cls, raw: dict[str, Any]) -> DecoderOptions:
        return _gemma(raw, qk_norm=False)


class Gemma3ForCausalLM(DecoderLM):
    @classmethod
    def options(cls, raw: dict[str, Any]) -> DecoderOptions:
        return _gemma(raw, qk_norm=True)
