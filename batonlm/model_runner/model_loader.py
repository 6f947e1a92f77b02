"""Build a model from its config (its class from `MODEL_ARCHITECTURES`, or transformers' own
with `cfg.impl == "transformers"`) and fill it from its checkpoint."""

from __future__ import annotations

from typing import Any

import torch

from batonlm.distributed.group import TPGroup
from batonlm.distributed.layout import TPLayout
from batonlm.model_runner.model_config import ModelConfig
from batonlm.model_runner.models.base import CausalLM
from batonlm.model_runner.weight_loader import (
    LoadStats,
    checkpoint_files,
    load_weights,
    open_checkpoint,
    weight_targets,
)
from batonlm.registries import MODEL_ARCHITECTURES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, cfg: ModelConfig, device: str) -> torch.dtype:
    """`auto`: float32 on the CPU; on a GPU the checkpoint's half type (bfloat16 for fp32 ones)."""
    if name != "auto":
        if name not in DTYPES:
            raise ValueError(f"dtype {name!r} is not supported (supported: auto, {', '.join(DTYPES)})")
        return DTYPES[name]
    if torch.device(device).type == "cpu":
        return torch.float32
    return DTYPES.get(cfg.torch_dtype, torch.bfloat16) if cfg.torch_dtype != "float32" else torch.bfloat16


def tp_layout(cfg: ModelConfig, rank: int, size: int) -> TPLayout:
    """Rank's share of the model among `size` tensor-parallel ranks (TPConfigError if impossible)."""
    return TPLayout(rank, size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size)


def multiplies_fp8(device: str | torch.device) -> bool:
    """Whether FP8 layers multiply in FP8 on `device` (online FP8 kept FP8, FP8 experts): the CPU
    (the torch references), or a GPU whose Triton has FP8 (compute capability 8.9 or more)."""
    if torch.device(device).type != "cuda":
        return True
    return torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (8, 9)


def keeps_quantized(cfg: ModelConfig, device: str | torch.device) -> bool:
    """Whether a quantized checkpoint's projections stay quantized by default: on CUDA (online
    FP8 only where the GPU multiplies FP8, compute capability 8.9 or more; elsewhere its rounded
    weights are dequantized), and W8A8 everywhere (its activations are quantized on every device:
    its outputs are the checkpoint's)."""
    quant = cfg.quantization
    if quant is None:
        return False
    if quant.act_quant != "none" and not quant.online:
        return True
    if torch.device(device).type != "cuda":
        return False
    return not quant.online or multiplies_fp8(device)


def build_meta_model(
    cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device, tp: TPGroup | None = None,
    shard: TPLayout | None = None, mlp_group: TPGroup | None = None, resident: bool | None = None,
) -> tuple[CausalLM, list[Any]]:
    """The native model as `load_model` builds it, on the meta device (nothing allocated, only
    the quantized checkpoint's headers read): its float parameters in `dtype`, and the quantized
    projections that stay quantized (`resident`; default: `keeps_quantized`) swapped for their
    quantized layers, returned beside it for loading."""
    model_class = MODEL_ARCHITECTURES[cfg.architecture]
    tp = tp or TPGroup.single()
    shard = shard or tp_layout(cfg, tp.rank, tp.size)
    with torch.device("meta"):
        model = model_class(cfg, shard, tp, mlp_group)
    model = model.to(dtype)
    quant = cfg.quantization
    layers: list[Any] = []
    if resident is None:
        resident = keeps_quantized(cfg, device)
    if quant is not None and resident:
        from batonlm.model_runner.quantization.dequantized import DequantizedCheckpoint, online_linears
        from batonlm.model_runner.quantization.resident import make_resident
        from batonlm.model_runner.quantization.resident_experts import make_resident_experts

        with DequantizedCheckpoint(checkpoint_files(cfg.path), quant) as ckpt:
            linears = online_linears(ckpt) if quant.online else ckpt.linears
            targets = weight_targets(model)
            layers = make_resident(model, ckpt, linears, quant, targets, dtype)
            layers += make_resident_experts(model, ckpt, linears, quant, targets, fp8_experts=multiplies_fp8(device))
    return model, layers


def load_model(
    cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device, tp: TPGroup | None = None,
    shard: TPLayout | None = None, mlp_group: TPGroup | None = None, resident: bool | None = None,
) -> tuple[CausalLM, LoadStats]:
    """The model (this rank's part of it: `shard`, by default the group's rank's; with DP
    attention its share of the MLP among `mlp_group`) and what loading it read. A quantized
    checkpoint's projections stay quantized (`resident`; default: `keeps_quantized`) or are
    dequantized."""
    if cfg.impl == "transformers":
        from batonlm.model_runner.models.transformers_fallback import load_transformers_model

        return load_transformers_model(cfg, dtype, device, tp, mlp_group)
    model, layers = build_meta_model(cfg, dtype, device, tp, shard, mlp_group, resident)
    quant = cfg.quantization
    model = model.to_empty(device=device)
    model.init_buffers(device)
    elsewhere = frozenset(f"{lin.prefix}.weight" for layer in layers for lin, _ in layer.sources)
    stats = load_weights(model, cfg.path, dtype, quant, elsewhere)
    if layers:
        assert quant is not None
        from batonlm.model_runner.quantization.resident import load_resident

        with open_checkpoint(checkpoint_files(cfg.path), quant) as ckpt:
            load_resident(layers, ckpt, quant)
            size = sum(ckpt.nbytes(m) for layer in layers for lin, _ in layer.sources for m in lin.members)
            stats = LoadStats(stats.bytes_read + ckpt.bytes_read, stats.checkpoint_bytes + size)
    return model.eval(), stats
