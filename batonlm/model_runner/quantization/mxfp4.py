"""MXFP4 weights (compressed-tensors' `mxfp4-pack-quantized`, llm-compressor's MXFP4A16 scheme, the
OCP microscaling format): each quantized linear layer stored under its module name as

- `weight_packed`: uint8 [N, K / 2], two FP4 (E2M1) codes a byte along K, NVFP4's packing
  (`nvfp4.py`: the even element in the low nibble, a sign bit and an index into 0 .. 6);
- `weight_scale`: uint8 [N, K / 32], one E8M0 exponent per group of 32 inputs of a row: the
  group's scale is 2^(e - 127) (exact in float32).

W = value(code) * 2^(e - 127): the packed int layout with the E2M1 codebook and float32 scales per
group of 32, kept packed where the integer formats are (CUDA), dequantized on load elsewhere.
"""

from __future__ import annotations

import torch

from batonlm.kernels.int4 import e8m0_scales
from batonlm.model_runner.checkpoint import Checkpoint
from batonlm.model_runner.quantization.config import QuantizationError
from batonlm.model_runner.quantization.int_weights import IntWeights
from batonlm.model_runner.quantization.nvfp4 import e2m1_weights

GROUP = 32


def members(names: set[str], prefix: str) -> tuple[str, ...]:
    absent = [p for p in ("weight_packed", "weight_scale") if f"{prefix}.{p}" not in names]
    if absent:
        raise QuantizationError(f"MXFP4 layer {prefix} lacks {', '.join(absent)}")
    return (f"{prefix}.weight_packed", f"{prefix}.weight_scale")


def int_weights(ckpt: Checkpoint, prefix: str, shape: tuple[int, int]) -> IntWeights:
    """The layer's codes [K, N] (unsigned 0..15), its groups' scales [K / 32, N] (powers of two,
    float32) and the E2M1 codebook."""
    exponent = ckpt.get(f"{prefix}.weight_scale")
    if exponent.dtype != torch.uint8:
        raise QuantizationError(f"MXFP4 layer {prefix}: weight_scale is {exponent.dtype}, not uint8 E8M0 exponents")
    scales = e8m0_scales(exponent)
    return e2m1_weights(ckpt.get(f"{prefix}.weight_packed"), exponent, scales, shape, GROUP, f"MXFP4 layer {prefix}")
