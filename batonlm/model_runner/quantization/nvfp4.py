"""NVFP4 weights (compressed-tensors' `nvfp4-pack-quantized`, llm-compressor's NVFP4A16 scheme):
each quantized linear layer stored under its module name as

- `weight_packed`: uint8 [N, K / 2], two FP4 (E2M1) codes a byte along K, the even element in
  the low nibble; a code is a sign (bit 3) and an index (bits 0-2) into 0, 0.5, 1, 1.5, 2, 3, 4, 6;
- `weight_scale`: float8 e4m3 [N, K / 16], one per group of 16 inputs of a row;
- `weight_global_scale`: float32 [1];
- with FP4 activations (the NVFP4 scheme, W4A4), `input_global_scale`: float32 [1], calibrated
  (kernels/fp4.py quantizes the layer's input with it).

W = value(code) * (weight_scale / weight_global_scale), in float32 (compressed-tensors'
dequantization: the group's scale divided by the global one, then the product, each rounded to
float32).

NVIDIA ModelOpt (`quant_algo` NVFP4 or W4A16_NVFP4, nvidia's *-FP4 repositories) stores the same
codes and group scales as `weight` (uint8 [N, K / 2]) and `weight_scale` (float8 e4m3 [N, K / 16]),
and the per-tensor scale the other way up: `weight_scale_2` (float32 [], amax / (6 * 448)),
W = value(code) * (weight_scale * weight_scale_2) (ModelOpt's `NVFP4QTensor.dequantize`); with FP4
activations `input_scale` (float32 [], likewise amax / (6 * 448)).

That is the packed int layout with a codebook (the 16 values) and float32 scales per
group of 16: kept packed where the integer formats are (CUDA), dequantized on load elsewhere.
"""

from __future__ import annotations

import dataclasses

import torch

from batonlm.model_runner.checkpoint import Checkpoint
from batonlm.model_runner.quantization.config import QuantizationError
from batonlm.model_runner.quantization.int_weights import IntWeights

GROUP = 16
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Each 4-bit code's value: the index's magnitude, negated when bit 3 is set.
CODEBOOK = torch.tensor(_E2M1 + tuple(-v for v in _E2M1), dtype=torch.float32)
# Each layout's tensors (codes, group scales, per-tensor scale) and its activations' scale.
_LAYOUTS = {"compressed-tensors": (("weight_packed", "weight_scale", "weight_global_scale"), "input_global_scale"),
            "modelopt": (("weight", "weight_scale", "weight_scale_2"), "input_scale")}


def members(names: set[str], prefix: str) -> tuple[str, ...] | None:
    """An NVFP4 layer's tensors in either layout, or None: not one (no per-tensor scale)."""
    for layout, (parts, act) in _LAYOUTS.items():
        if f"{prefix}.{parts[2]}" not in names:
            continue
        absent = [p for p in parts if f"{prefix}.{p}" not in names]
        if absent:
            raise QuantizationError(f"NVFP4 layer {prefix} ({layout}'s layout) lacks {', '.join(absent)}")
        # its FP4 input scale, and ModelOpt's NVFP4_AWQ `pre_quant_scale` (the input scaled first)
        extra = tuple(f"{prefix}.{n}" for n in (act, "pre_quant_scale") if f"{prefix}.{n}" in names)
        return tuple(f"{prefix}.{p}" for p in parts) + extra
    return None


def layout(members: tuple[str, ...]) -> str:
    """Which layout a layer's `members` are in: "compressed-tensors" or "modelopt"."""
    return "modelopt" if members[0].endswith(".weight") else "compressed-tensors"


def input_scale_name(members: tuple[str, ...]) -> str:
    """The leaf name of the layer's FP4 activations' scale in its layout."""
    return _LAYOUTS[layout(members)][1]


def input_scale(ckpt: Checkpoint, prefix: str, members: tuple[str, ...]) -> torch.Tensor:
    """The layer's FP4 activations' scale as its format stores it (float32 []), or a start-up
    error where a W4A4 layer has none."""
    name = f"{prefix}.{input_scale_name(members)}"
    if name not in members:
        raise QuantizationError(f"{prefix} lacks {input_scale_name(members)} (NVFP4 with FP4 activations)")
    return ckpt.get(name).to(torch.float32).reshape(())


def int_weights(ckpt: Checkpoint, prefix: str, shape: tuple[int, int], members: tuple[str, ...]) -> IntWeights:
    """The layer's codes [K, N] (unsigned 0..15), its groups' float32 scales [K / 16, N] and the
    E2M1 codebook."""
    packed, scale, tensor_scale = (ckpt.get(m) for m in members[:3])
    per_tensor = tensor_scale.to(torch.float32).reshape(())
    modelopt = layout(members) == "modelopt"
    scales = scale.to(torch.float32) * per_tensor if modelopt else scale.to(torch.float32) / per_tensor
    iw = e2m1_weights(packed, scale, scales, shape, GROUP, f"NVFP4 layer {prefix}")
    return dataclasses.replace(iw, scale_2=per_tensor.expand(shape[0]).contiguous(), scale_2_divides=not modelopt)


def e2m1_weights(packed: torch.Tensor, stored_scale: torch.Tensor, scales: torch.Tensor, shape: tuple[int, int],
                 group: int, what: str) -> IntWeights:
    """FP4 codes packed two a byte along K (uint8 [N, K / 2], the low nibble first) with float32
    `scales` [N, K / group] (decoded from the checkpoint's `stored_scale`, its shape checked) as
    the packed int layout's values: codes [K, N] (unsigned 0..15), scales [G, N] (and as stored),
    the E2M1 codebook, no zeros. NVFP4's and MXFP4's layers alike."""
    n, k = shape
    groups = -(-k // group)
    if packed.dtype != torch.uint8 or tuple(packed.shape) != (n, k // 2) or tuple(stored_scale.shape) != (n, groups):
        raise QuantizationError(f"{what}: its codes ({packed.dtype} {list(packed.shape)}) and group scales "
                                f"({stored_scale.dtype} {list(stored_scale.shape)}) are not a [{n}, {k}] weight's")
    codes = torch.stack([packed & 15, packed >> 4], dim=2).reshape(n, k)  # the low nibble first
    zeros = torch.zeros(groups, n, dtype=torch.int32)
    return IntWeights(codes.t().contiguous().to(torch.int32), zeros, scales.t().contiguous(),
                      torch.arange(k) // group, 4, CODEBOOK, stored_scales=stored_scale.t().contiguous())
