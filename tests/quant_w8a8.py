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

import re
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
                               linears: tuple[str, ...] = LINEARS, kind: str = "int",
                               asym_activations: bool = False) -> dict[str, torch.Tensor]:
    """The checkpoint (`kind` "int": W8A8 int8; "float": FP8_DYNAMIC), with the other tensors in
    `dtype`; returns the dequantized float32 weights (codes * scale: what the weights mean; its
    activations are quantized on top). `asym_activations`: int8 activations with zero points
    (`symmetric: false`, as the `w8a8-asym` fixture: the same tensors, only the config differs)."""
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
    if asym_activations:
        group["input_activations"].update(symmetric=False, zp_dtype="torch.int8")
    qconfig = {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"group_0": group},
               "ignore": ["lm_head"], "kv_cache_scheme": None, "quantization_status": "compressed",
               "sparsity_config": {}, "transform_config": {}, "global_compression_ratio": None}
    _finish(src, out, config, qconfig, result, str(dtype).removeprefix("torch."))
    return deq


def _input_of(prefix: str) -> str:
    """The layers that read one input (q/k/v; gate and up, Mixtral's w1 and w3) share a name."""
    return re.sub(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj|w1|w3)$", ".input", prefix)


def static_input_scales(names: list[str], qmax: float, seed: int = 0, shared_inputs: bool = True,
                        ) -> dict[str, torch.Tensor]:
    """A static activation scale per layer (float32, 0-dim), as a calibration would give one: an
    input range of 1 to 6 over the format's largest code, drawn per input (the layers reading one
    input observe the same values, so calibration gives them one scale; `shared_inputs` False:
    per layer, as a checkpoint may still have them), so experts differ and large inputs saturate."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    drawn: dict[str, torch.Tensor] = {}
    for n in names:
        prefix = n.removesuffix(".weight")
        key = _input_of(prefix) if shared_inputs else prefix
        if key not in drawn:
            drawn[key] = (1 + 5 * torch.rand((), generator=g)) / qmax
        out[prefix] = drawn[key].clone()
    return out


def write_static_checkpoint(src_dir: str | Path, out_dir: str | Path, kind: str,
                            linears: tuple[str, ...] = LINEARS, seed: int = 0, shared_inputs: bool = True,
                            ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A checkpoint with static (calibrated) activation scales: `kind` "autofp8" is AutoFP8's
    `quant_method: fp8, activation_scheme: static` (the FP8 Mixtral and Llama checkpoints): each
    weight FP8 e4m3 with one float32 `weight_scale` per tensor (amax / 448) and a float32
    `input_scale`, both 0-dim, the other tensors as they are; "int8" is llm-compressor's W8A8
    int8 with static per-tensor activations (as the `w8a8-static` fixture: int8 weights per
    channel, a [1] `input_scale` in bfloat16, the other tensors in bfloat16). The scales are
    `static_input_scales`' (no calibration run: any positive scale is a valid checkpoint).
    `linears`: the projections quantized (a MoE's expert names; its router stays float).
    Returns (the dequantized float32 weights, each layer's input scale as float32)."""
    src, out = Path(src_dir), Path(out_dir)
    config, tensors = load_float_checkpoint(src)
    names = sorted(n for n in tensors if is_quantized_linear(n, linears))
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    inputs = static_input_scales(names, fp8_max if kind == "autofp8" else 127.5, seed, shared_inputs)
    result: dict[str, torch.Tensor] = {}
    deq: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for name, w in tensors.items():
        if name not in names:
            result[name] = w if kind == "autofp8" or not w.is_floating_point() else w.to(torch.bfloat16)
            continue
        prefix = name.removesuffix(".weight")
        if kind == "autofp8":
            scale = (w.float().abs().amax() / fp8_max).clamp_min(torch.finfo(torch.float32).tiny)
            q = (w.float() / scale).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn)
            result[name], result[f"{prefix}.weight_scale"] = q, scale
            result[f"{prefix}.input_scale"] = inputs[prefix]
        else:
            q, scale = w8a8_int8_quantize(w, torch.bfloat16)
            result[name], result[f"{prefix}.weight_scale"] = q, scale
            result[f"{prefix}.input_scale"] = inputs[prefix].reshape(1).to(torch.bfloat16)
        deq[name] = q.to(torch.float32) * scale.to(torch.float32)
        scales[prefix] = result[f"{prefix}.input_scale"].to(torch.float32).reshape(())
    if kind == "autofp8":
        qconfig: dict = {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}
        dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    else:
        args = dict(_INT8, type="int")
        group = {"targets": ["Linear"], "format": "int-quantized", "output_activations": None,
                 "weights": {**args, "strategy": "channel", "dynamic": False, "observer": "memoryless_minmax"},
                 "input_activations": {**args, "strategy": "tensor", "dynamic": False, "observer": "minmax"}}
        qconfig = {"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"group_0": group},
                   "ignore": ["lm_head"], "kv_cache_scheme": None, "quantization_status": "compressed",
                   "sparsity_config": {}, "transform_config": {}, "global_compression_ratio": None}
        dtype = "bfloat16"
    _finish(src, out, config, qconfig, result, dtype)
    return deq, scales
