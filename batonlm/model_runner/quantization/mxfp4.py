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

from batonlm.model_runner.checkpoint import Checkpoint
from batonlm.model_runner.quantization.config import QuantizationError
from batonlm.model_runner.quantization.int_weights import IntWeights
from batonlm.model_runner.quantization.nvfp4 import CODEBOOK

GROUP = 32
_BIAS = 127


def members(names: set[str], prefix: str) -> tuple[str, ...]:
    absent = [p for p in ("weight_packed", "weight_scale") if f"{prefix}.{p}" not in names]
    if absent:
        raise QuantizationError(f"MXFP4 layer {prefix} lacks {', '.join(absent)}")
    return (f"{prefix}.weight_packed", f"{prefix}.weight_scale")


def int_weights(ckpt: Checkpoint, prefix: str, shape: tuple[int, int]) -> IntWeights:
    """The layer's codes [K, N] (unsigned 0..15), its groups' scales [K / 32, N] (powers of two,
    float32) and the E2M1 codebook."""
    n, k = shape
    packed, exponent = ckpt.get(f"{prefix}.weight_packed"), ckpt.get(f"{prefix}.weight_scale")
    groups = -(-k // GROUP)
    if packed.dtype != torch.uint8 or exponent.dtype != torch.uint8 or tuple(packed.shape) != (n, k // 2) or \
            tuple(exponent.shape) != (n, groups):
        raise QuantizationError(f"MXFP4 layer {prefix}: weight_packed {packed.dtype} {list(packed.shape)} and "
                                f"weight_scale {exponent.dtype} {list(exponent.shape)} are not a [{n}, {k}] weight's")
    codes = torch.stack([packed & 15, packed >> 4], dim=2).reshape(n, k)  # the low nibble first
    scales = torch.ldexp(torch.ones(n, groups), exponent.to(torch.int32) - _BIAS).t().contiguous()  # [G, N]
    zeros = torch.zeros(groups, n, dtype=torch.int32)
    return IntWeights(codes.t().contiguous().to(torch.int32), zeros, scales, torch.arange(k) // GROUP, 4, CODEBOOK)
