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
float32). That is the packed int layout with a codebook (the 16 values) and float32 scales per
group of 16: kept packed where the integer formats are (CUDA), dequantized on load elsewhere.
"""

from __future__ import annotations

import torch

from batonlm.model_runner.checkpoint import Checkpoint
from batonlm.model_runner.quantization.config import QuantizationError
from batonlm.model_runner.quantization.int_weights import IntWeights

GROUP = 16
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Each 4-bit code's value: the index's magnitude, negated when bit 3 is set.
CODEBOOK = torch.tensor(_E2M1 + tuple(-v for v in _E2M1), dtype=torch.float32)
_PARTS = ("weight_packed", "weight_scale", "weight_global_scale")


def members(names: set[str], prefix: str) -> tuple[str, ...] | None:
    """An NVFP4 layer's tensors, or None: not one (no global scale)."""
    if f"{prefix}.weight_global_scale" not in names:
        return None
    absent = [p for p in _PARTS if f"{prefix}.{p}" not in names]
    if absent:
        raise QuantizationError(f"NVFP4 layer {prefix} lacks {', '.join(absent)}")
    extra = (f"{prefix}.input_global_scale",) if f"{prefix}.input_global_scale" in names else ()
    return tuple(f"{prefix}.{p}" for p in _PARTS) + extra


def int_weights(ckpt: Checkpoint, prefix: str, shape: tuple[int, int]) -> IntWeights:
    """The layer's codes [K, N] (unsigned 0..15), its groups' float32 scales [K / 16, N] and the
    E2M1 codebook."""
    n, k = shape
    packed = ckpt.get(f"{prefix}.weight_packed")
    scale = ckpt.get(f"{prefix}.weight_scale")
    groups = -(-k // GROUP)
    if packed.dtype != torch.uint8 or tuple(packed.shape) != (n, k // 2) or tuple(scale.shape) != (n, groups):
        raise QuantizationError(f"NVFP4 layer {prefix}: weight_packed {packed.dtype} {list(packed.shape)} and "
                                f"weight_scale {list(scale.shape)} are not a [{n}, {k}] weight's")
    codes = torch.stack([packed & 15, packed >> 4], dim=2).reshape(n, k)  # the low nibble first
    glob = ckpt.get(f"{prefix}.weight_global_scale").to(torch.float32).reshape(())
    scales = (scale.to(torch.float32) / glob).t().contiguous()  # [G, N]
    zeros = torch.zeros(groups, n, dtype=torch.int32)
    return IntWeights(codes.t().contiguous().to(torch.int32), zeros, scales, torch.arange(k) // GROUP, 4, CODEBOOK)
