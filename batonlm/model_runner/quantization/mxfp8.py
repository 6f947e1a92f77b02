"""MXFP8 weights (the OCP microscaling format with FP8 e4m3 elements): compressed-tensors'
`mxfp8-quantized` (llm-compressor's MXFP8 and MXFP8A16 schemes) and NVIDIA ModelOpt's `MXFP8`, each
quantized linear layer stored under its module name as

- `weight`: float8 e4m3 [N, K];
- `weight_scale`: uint8 [N, K / 32], one E8M0 exponent per group of 32 inputs of a row: the
  group's scale is 2^(e - 127) (exact in float32).

W = value * 2^(e - 127): the packed layout's 8-bit codes through the e4m3 table
(`fp8_weight_only.codebook`) with the exponents kept as bytes (`stored_scales` "e8m0", as MXFP4's:
1.03 bytes a weight). MXFP8 checkpoints quantize their inputs too, per 32 with E8M0 scales, each
tool in its own arithmetic (kernels/mxfp8.py); MXFP8A16's stay float.
"""

from __future__ import annotations

import torch

from batonlm.kernels.int4 import e8m0_scales
from batonlm.model_runner.checkpoint import Checkpoint
from batonlm.model_runner.quantization.config import QuantizationError
from batonlm.model_runner.quantization.fp8_weight_only import fp8_codes
from batonlm.model_runner.quantization.int_weights import IntWeights

GROUP = 32


def int_weights(ckpt: Checkpoint, prefix: str, shape: tuple[int, int]) -> IntWeights:
    """The layer's codes [K, N] (the FP8 bytes), its groups' scales [K / 32, N] (powers of two,
    float32; and the exponents as stored) and the FP8 table."""
    n, k = shape
    exponent = ckpt.get(f"{prefix}.weight_scale")
    groups = -(-k // GROUP)
    if tuple(exponent.shape) != (n, groups):
        raise QuantizationError(f"MXFP8 layer {prefix}: weight_scale of shape {list(exponent.shape)} is not one E8M0 "
                                f"exponent per 32 inputs of a [{n}, {k}] weight ([{n}, {groups}])")
    return fp8_codes(ckpt, prefix, e8m0_scales(exponent), torch.arange(k) // GROUP, stored_scales=exponent)
