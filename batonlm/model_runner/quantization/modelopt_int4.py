"""NVIDIA ModelOpt's int4 weights (`quant_algo: W4A16_AWQ`, `mtq.INT4_AWQ_CFG` exported): each
quantized linear layer [N, K] stored under its module name as

- `weight`: uint8 [N / 2, K], two signed 4-bit codes (two's complement, -8 .. 7) a byte, rows 2i
  (the low nibble) and 2i + 1 (the high) of a column (ModelOpt's `pack_int4_in_uint8`);
- `weight_scale`: float32 [N, K / G], one per group of G inputs of a row (G = 128 by default);
- `pre_quant_scale` (bfloat16 [K]), AWQ's smoothing: the layer's input is multiplied by it first.
  ModelOpt's export folds it into the preceding norm where there is one (q/k/v, gate/up), so the
  layers after another linear (o_proj, down_proj) keep theirs.

W = q * scale (symmetric, no zeros): the packed int layout with a zero of 8 on codes q + 8.
"""

from __future__ import annotations

import torch

from batonlm.model_runner.checkpoint import Checkpoint
from batonlm.model_runner.quantization.config import QuantizationError
from batonlm.model_runner.quantization.int_weights import IntWeights


def is_int4(ckpt: Checkpoint, names: set[str], prefix: str) -> bool:
    """uint8 codes two a byte along N (half the rows of the float32 scale's [N, G])."""
    p = f"{prefix}."
    if ckpt.dtype(p + "weight") != "U8" or p + "weight_scale" not in names or ckpt.dtype(p + "weight_scale") != "F32":
        return False
    codes, scale = ckpt.shape(p + "weight"), ckpt.shape(p + "weight_scale")
    return len(codes) == 2 and len(scale) == 2 and 2 * codes[0] == scale[0]


def shape(ckpt: Checkpoint, prefix: str) -> tuple[int, int]:
    return ckpt.shape(f"{prefix}.weight_scale")[0], ckpt.shape(f"{prefix}.weight")[1]


def layout(ckpt: Checkpoint, prefix: str) -> tuple[int, int, int]:
    """(4 bits, group size in input rows (-1: one group), number of groups)."""
    n, k = shape(ckpt, prefix)
    groups = ckpt.shape(f"{prefix}.weight_scale")[1]
    size = -(-k // groups)
    if -(-k // size) != groups:
        raise QuantizationError(f"{prefix}.weight_scale: {groups} groups do not fit {k} input features")
    return 4, (size if groups > 1 else -1), groups


def int_weights(ckpt: Checkpoint, prefix: str) -> IntWeights:
    """The layer's codes [K, N] (unsigned: q + 8), zeros 8, scales [G, N] float32, row groups."""
    n, k = shape(ckpt, prefix)
    packed = ckpt.get(f"{prefix}.weight").to(torch.int32)  # [N / 2, K]
    low, high = packed & 15, packed >> 4
    codes = torch.stack([low, high], dim=1).reshape(n, k)  # rows 2i, 2i + 1
    signed = torch.where(codes >= 8, codes - 16, codes)
    _, size, groups = layout(ckpt, prefix)
    scales = ckpt.get(f"{prefix}.weight_scale").to(torch.float32)
    rows = torch.arange(k) // size if groups > 1 else torch.zeros(k, dtype=torch.int64)
    return IntWeights((signed + 8).t().contiguous(), torch.full((groups, n), 8, dtype=torch.int32),
                      scales.t().contiguous(), rows, 4)
