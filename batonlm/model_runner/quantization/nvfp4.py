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
    scale = ckpt.get(f"{prefix}.weight_scale")
    glob = ckpt.get(f"{prefix}.weight_global_scale").to(torch.float32).reshape(())
    return e2m1_weights(ckpt.get(f"{prefix}.weight_packed"), scale, scale.to(torch.float32) / glob, shape, GROUP,
                        f"NVFP4 layer {prefix}")


def e2m1_weights(packed: torch.Tensor, stored_scale: torch.Tensor, scales: torch.Tensor, shape: tuple[int, int],
                 group: int, what: str) -> IntWeights:
    """FP4 codes packed two a byte along K (uint8 [N, K / 2], the low nibble first) with float32
    `scales` [N, K / group] (decoded from the checkpoint's `stored_scale`, its shape checked) as
    the packed int layout's values: codes [K, N] (unsigned 0..15), scales [G, N], the E2M1
    codebook, no zeros. NVFP4's and MXFP4's layers alike."""
    n, k = shape
    groups = -(-k // group)
    if packed.dtype != torch.uint8 or tuple(packed.shape) != (n, k // 2) or tuple(stored_scale.shape) != (n, groups):
        raise QuantizationError(f"{what}: weight_packed {packed.dtype} {list(packed.shape)} and weight_scale "
                                f"{stored_scale.dtype} {list(stored_scale.shape)} are not a [{n}, {k}] weight's")
    codes = torch.stack([packed & 15, packed >> 4], dim=2).reshape(n, k)  # the low nibble first
    zeros = torch.zeros(groups, n, dtype=torch.int32)
    return IntWeights(codes.t().contiguous().to(torch.int32), zeros, scales.t().contiguous(),
                      torch.arange(k) // group, 4, CODEBOOK)
