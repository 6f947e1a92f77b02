"""Write W8A8 checkpoints from a float checkpoint as llm-compressor writes them (its `W8A8` and
`FP8_DYNAMIC` schemes, round to nearest: `QuantizationModifier(scheme=...)`), for tests and
benchmarks of models the fixtures' tool run does not cover (other shapes, families, MoE).

compressed-tensors `int-quantized` / `float-quantized`: every decoder linear's `weight` (int8 or
FP8 e4m3 [N, K]) with a `weight_scale` [N, 1] in the checkpoint's half dtype, symmetric per
output channel; the inputs quantized per token at run time (`input_activations`: dynamic, token).
Computed as llm-compressor computes it on a bfloat16 model, in bfloat16: int8 scale = amax /
127.5, codes = round-half-even(w / scale) clamped to [-128, 127]; FP8 scale = amax / 448, codes =
(w / scale) clamped to +-448 and rounded to e4m3. tests/unit/test_quant_formats.py checks both
against the llm-compressor fixtures (tests/data/quantized/w8a8, fp8-dynamic) byte for byte.
"""

from __future__ import annotations

from pathlib import Path

import torch
from quant_formats import LINEARS, _finish, is_quantized_linear, load_float_checkpoint

_INT8 = {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None, "block_structure": None,
         "actorder": None, "observer_kwargs": {}, "scale_dtype": None, "zp_dtype": None}


def w8a8_int8_quantize(w: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (codes int8 [N, K], scale [N, 1] in `dtype`), in `dtype`'s arithmetic."""
    w = w.to(dtype)
    scale = w.abs().amax(dim=1, keepdim=True) / torch.tensor(127.5, dtype=dtype)
    scale = torch.where(scale == 0, torch.tensor(torch.finfo(dtype).eps, dtype=dtype), scale)
    return torch.round(w / scale).clamp(-128, 127).to(torch.int8), scale


def fp8_channel_quantize(w: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (codes float8_e4m3fn [N, K], scale [N, 1] in `dtype`), in `dtype`'s arithmetic."""
    w = w.to(dtype)
    scale = w.abs().amax(dim=1, keepdim=True) / torch.tensor(448.0, dtype=dtype)
    scale = torch.where(scale == 0, torch.tensor(torch.finfo(dtype).eps, dtype=dtype), scale)
    return (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale


def write_w8a8_checkpoint(src_dir: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16,
                               linears: tuple[str, ...] = LINEARS, kind: str = "int") -> dict[str, torch.Tensor]:
    """The checkpoint (`kind` "int": W8A8 int8; "float": FP8_DYNAMIC), with the other tensors in
    `dtype`; returns the dequantized float32 weights (codes * scale: what the weights mean; its
    activations are quantized on top)."""
    src, out = Path(src_dir), Path(out_dir)
    config, tensors = load_float_checkpoint(src)
    result: dict[str, torch.Tensor] = {}
    deq: dict[str, torch.Tensor] = {}
    for name, w in tensors.items():
        if not is_quantized_linear(name, linears):
            result[name] = w.to(dtype) if w.is_floating_point() else w
            continue
        q, scale = (w8a8_int8_quantize if kind == "int" else fp8_channel_quantize)(w, dtype)
        result[name], result[name + "_scale"] = q, scale
        deq[name] = q.to(torch.float32) * scale.to(torch.float32)
    args = dict(_INT8, type=kind)
    fmt = f"{kind}-quantized"
    group = {"targets": ["Linear"], "format": fmt, "output_activations": None,
             "weights": {**args, "strategy": "channel", "dynamic": False, "observer": "memoryless_minmax"},
             "input_activations": {**args, "strategy": "token", "dynamic": True, "observer": None}}
    qconfig = {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"group_0": group},
               "ignore": ["lm_head"], "kv_cache_scheme": None, "quantization_status": "compressed",
               "sparsity_config": {}, "transform_config": {}, "global_compression_ratio": None}
    _finish(src, out, config, qconfig, result, str(dtype).removeprefix("torch."))
    return deq
