"""The bytes of weights one rank holds, counted on the model itself: the family's class built on
the meta device for that rank (its heads, its vocabulary rows, its slice of every expert, MLA's
replicated latent projections), or transformers' for the fallback. Nothing is allocated or read.

The GPU's KV budget is what is left after them (`device/spec.py`); a formula over the config
would have to know every family (it counted a dense MLP where a mixture of experts holds E).
A quantized checkpoint's projections count at the serving dtype (an upper bound where they
stay quantized)."""

from __future__ import annotations

import torch

from batonlm.distributed.group import TPGroup
from batonlm.model_runner.model_config import ModelConfig


def weight_bytes(cfg: ModelConfig, dtype: torch.dtype, tp: int = 1, mlp_split: int | None = None) -> int:
    """Rank 0's weights among `tp` tensor-parallel ranks (the first ranks take one more row of
    an uneven split), the MLP split over `mlp_split` ranks with DP attention, in `dtype`."""
    size = torch.empty((), dtype=dtype).element_size()
    return sum(p.numel() for p in _meta_model(cfg, tp, mlp_split).parameters()) * size


def _meta_model(cfg: ModelConfig, tp: int, mlp_split: int | None) -> torch.nn.Module:
    if cfg.impl == "transformers":
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cfg.path))
    from batonlm.model_runner.model_loader import tp_layout
    from batonlm.registries import MODEL_ARCHITECTURES

    group = TPGroup(0, tp)
    mlp_group = TPGroup(0, mlp_split) if mlp_split is not None and mlp_split != tp else None
    with torch.device("meta"):
        return MODEL_ARCHITECTURES[cfg.architecture](cfg, tp_layout(cfg, 0, tp), group, mlp_group)
