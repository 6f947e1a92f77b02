"""Rotary position embedding settings read from a Hugging Face config: the base, the rotated
fraction of a head, and the `linear`, `llama3`, `yarn` and `longrope` scalings; Gemma 3's second
rotary for its sliding layers. The tables themselves are computed in `layers.py` as
transformers computes them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


class RopeConfigError(ValueError):
    """The config's rotary settings cannot be served."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    # "default", "linear", "llama3", "yarn" or "longrope"; anything else is rejected at load time.
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # YaRN: the ramp between interpolated and extrapolated frequencies, and the factor cos/sin
    # are multiplied by (None: from `factor`, `mscale` and `mscale_all_dim` as transformers does).
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True
    # LongRoPE (Phi-3): per-frequency divisors below `original_max_position_embeddings` and from it.
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    # The leading fraction of each head that is rotated (Phi-4-mini: 0.75); the rest passes as is.
    partial_rotary_factor: float = 1.0


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature: 0.1 * mscale * ln(factor) + 1 (1 when not scaled up)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def read_ropes(text: dict[str, Any]) -> tuple[RopeConfig, RopeConfig | None]:
    """The rotary of the full-attention layers, and the sliding layers' where it differs
    (Gemma 3: `rope_parameters` per layer type, or the older `rope_local_base_freq`)."""
    params = text.get("rope_parameters") or {}
    if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
        full, local = params.get("full_attention") or {}, params.get("sliding_attention")
        return _rope({**text, "rope_parameters": full}), None if local is None else _rope(
            {**text, "rope_parameters": local, "rope_scaling": None})
    local_theta = text.get("rope_local_base_freq")
    return _rope(text), None if local_theta is None else RopeConfig(theta=float(local_theta))


def _rope(text: dict[str, Any]) -> RopeConfig:
    # transformers 5 writes `rope_parameters` (theta included); older checkpoints use
    # `rope_theta` + `rope_scaling`.
    params = dict(text.get("rope_parameters") or {})
    scaling = dict(text.get("rope_scaling") or {})
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", text.get("rope_theta", 10000.0)))
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    if text.get("model_type") == "phi3" and rope_type in ("su", "yarn"):  # Phi-3's names for LongRoPE
        rope_type = "longrope"
    if rope_type not in ("default", "linear", "llama3", "yarn", "longrope"):
        raise RopeConfigError(
            f"rope scaling type {rope_type!r} is not supported (supported: default, linear, llama3, yarn, longrope)"
        )
    original = params.get("original_max_position_embeddings") or text.get("original_max_position_embeddings")
    factor = params.get("factor")
    if rope_type in ("yarn", "longrope") and factor is None:  # the context's growth (DeepSeek-V3, Phi-3)
        if not original:
            raise RopeConfigError(f"{rope_type} rope scaling needs 'factor' or 'original_max_position_embeddings'")
        factor = int(text.get("max_position_embeddings", 2048)) / int(original)
    short, long = tuple(map(float, params.get("short_factor") or ())), tuple(map(float, params.get("long_factor") or ()))
    if rope_type == "longrope" and not (short and long and len(short) == len(long)):
        raise RopeConfigError("longrope rope scaling needs 'short_factor' and 'long_factor' lists of one length")
    attention_factor = params.get("attention_factor")
    return RopeConfig(
        theta=theta,
        type=rope_type,
        factor=float(1.0 if factor is None else factor),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(original or 8192),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=float(params.get("mscale") or 0.0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        attention_factor=None if attention_factor is None else float(attention_factor),
        truncate=bool(params.get("truncate", True)),
        short_factor=short,
        long_factor=long,
        partial_rotary_factor=float(params.get("partial_rotary_factor") or text.get("partial_rotary_factor") or 1.0),
    )
