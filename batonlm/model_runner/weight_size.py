"""The bytes of weights one rank holds, counted on the model itself: built on the meta device as
the loader builds it for that rank (its heads, its vocabulary rows, its slice of every expert,
MLA's replicated latent projections, and a quantized checkpoint's projections in the quantized
layers that keep them: packed int4, FP8 and their scales), or transformers' for the fallback.
Nothing is allocated; only a quantized checkpoint's headers are read.

The GPU's KV budget is what is left after them (`device/spec.py`); a formula over the config
would have to know every family and format (it counted a dense MLP where a mixture of experts
holds E, and float weights where int4 ones stay packed)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from batonlm.distributed.group import TPGroup
from batonlm.model_runner.model_config import ModelConfig


def weight_bytes(cfg: ModelConfig, dtype: torch.dtype, tp: int = 1, mlp_split: int | None = None,
                 device: str = "cuda", resident: bool | None = None) -> int:
    """Rank 0's weights among `tp` tensor-parallel ranks (the first ranks take one more row of
    an uneven split), the MLP split over `mlp_split` ranks with DP attention, float ones in
    `dtype`, as loaded on `device` (`resident`: as `model_loader.load_model` takes it)."""
    return sum(t.numel() * t.element_size() for t in held_tensors(_meta_model(cfg, dtype, tp, mlp_split, device,
                                                                              resident)))


def held_tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    """A model's weights: its parameters and persistent buffers (a quantized layer's packed
    weight and scales), each once; not the tables it recomputes (rotary)."""
    yield from model.parameters()
    seen: set[int] = set()
    for module in model.modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in module._non_persistent_buffers_set and id(buf) not in seen:
                seen.add(id(buf))
                yield buf


def _meta_model(cfg: ModelConfig, dtype: torch.dtype, tp: int, mlp_split: int | None, device: str,
                resident: bool | None) -> nn.Module:
    if cfg.impl == "transformers":
        from transformers import AutoModelForCausalLM

        from batonlm.model_runner.models.transformers_fallback import float_config

        with torch.device("meta"):  # (a quantized checkpoint runs dequantized: float weights)
            return AutoModelForCausalLM.from_config(float_config(cfg.path)).to(dtype)
    from batonlm.model_runner.model_loader import build_meta_model

    mlp_group = TPGroup(0, mlp_split) if mlp_split is not None and mlp_split != tp else None
    return build_meta_model(cfg, dtype, device, TPGroup(0, tp), None, mlp_group, resident)[0]
