"""FP8 weights whose activations stay float (W8A16 FP8): NVIDIA ModelOpt's FP8_PB_WO (a float32
scale per 128x128 block: its export's `weight_scale` [N/128, 1, K/128, 1], or [N/128, K/128]),
and compressed-tensors' float 8-bit weights without `input_activations` (a scale per tensor,
channel or block).

Their inputs are not quantized, so they are not `Fp8Linear`s (W8A8): they run as the packed
weight-only layers do, 8-bit codes whose values are the FP8 format's table (`codebook`, a
`PackedIntLinear` codebook of 256 entries) times a float32 scale per output row and group of K
(a block's scale on each of its rows). W = value * scale, the one float32 rounding of the FP8
dequantization, so the packed layer, the dequantized one and ModelOpt's `FP8QTensor.dequantize`
give the same weights; 1 byte a weight plus 4 per row and block.
"""

from __future__ import annotations

import math

import torch

from batonlm.model_runner.checkpoint import Checkpoint
from batonlm.model_runner.quantization.config import QuantConfig, QuantizationError
from batonlm.model_runner.quantization.int_weights import IntWeights

# ModelOpt's FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG blocks (its config does not state them).
MODELOPT_BLOCK = (128, 128)
_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def codebook(dtype: str) -> torch.Tensor:
    """Each 8-bit code's value in the checkpoint's FP8 format (float32 [256]; the NaN codes NaN)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(_DTYPES[dtype]).to(torch.float32)


def _per_channel(scale: tuple[int, ...], n: int) -> bool:
    return math.prod(scale) == 1 or scale in ((n,), (n, 1))


def weight_only(ckpt: Checkpoint, names: set[str], prefix: str, scale: str, quant: QuantConfig, n: int) -> bool:
    """An FP8 layer whose inputs are not quantized: the checkpoint's (or the layer's config
    group's) activations are float, or a
    ModelOpt layer scaled per block without an input scale (FP8_PB_WO, also among a
    MIXED_PRECISION checkpoint's layers: ModelOpt's W8A8 FP8 is per tensor or channel)."""
    if not quant.quantizes_inputs(prefix):  # (compressed-tensors: by the config group the layer is in)
        return True
    return (quant.method == "modelopt" and f"{prefix}.input_scale" not in names
            and not _per_channel(tuple(ckpt.shape(scale)), n))


def _block(quant: QuantConfig) -> tuple[int, int]:
    return quant.block or MODELOPT_BLOCK


def layout(ckpt: Checkpoint, name: str, shape: tuple[int, int], quant: QuantConfig) -> tuple[int, int, int]:
    """(8 bits, group size in input rows (-1: one group), number of groups) from the scale's shape."""
    n, k = shape
    if _per_channel(tuple(ckpt.shape(name)), n):
        return 8, -1, 1
    bk = _block(quant)[1]
    groups = -(-k // bk)
    return 8, bk if groups > 1 else -1, groups


def block_scales(ckpt: Checkpoint, name: str, shape: tuple[int, int], quant: QuantConfig,
                 ) -> tuple[torch.Tensor, tuple[int, int]]:
    """The layer's scales as float32 [ceil(N / bn), ceil(K / bk)] and its block (bn, bk): per
    tensor (N, K), per channel (1, K), or per block (the config's, else ModelOpt's 128x128)."""
    n, k = shape
    s = ckpt.get(name).to(torch.float32)
    if s.numel() == 1:
        return s.reshape(1, 1), (n, k)
    if tuple(s.shape) in ((n,), (n, 1)):
        return s.reshape(n, 1), (1, k)
    bn, bk = _block(quant)
    if s.dim() == 4 and s.shape[1] == s.shape[3] == 1:  # ModelOpt's export keeps the reduced dims
        s = s.reshape(s.shape[0], s.shape[2])
    if tuple(s.shape) != (-(-n // bn), -(-k // bk)):
        raise QuantizationError(f"{name} of shape {tuple(ckpt.shape(name))} is not a scale per tensor, channel or "
                                f"{bn}x{bk} block of a [{n}, {k}] FP8 weight")
    return s, (bn, bk)


def fp8_codes(ckpt: Checkpoint, prefix: str, scales: torch.Tensor, groups: torch.Tensor,
              stored_scales: torch.Tensor | None = None) -> IntWeights:
    """A layer's FP8 `weight` as 8-bit codes [K, N] through the format's table, with float32
    `scales` [N, G] per row and group, each input row's group (and the scales as stored)."""
    n = scales.shape[0]
    q = ckpt.get(f"{prefix}.weight").view(torch.uint8).to(torch.int32).t().contiguous()
    return IntWeights(q, torch.zeros(scales.shape[1], n, dtype=torch.int32), scales.t().contiguous(), groups, 8,
                      codebook(ckpt.dtype(f"{prefix}.weight")),
                      stored_scales=None if stored_scales is None else stored_scales.t().contiguous())


def int_weights(ckpt: Checkpoint, prefix: str, scale: str, shape: tuple[int, int], quant: QuantConfig) -> IntWeights:
    """The FP8 codes through the format's table, a scale per row and group (a block's on each of its rows)."""
    n, k = shape
    s, (bn, bk) = block_scales(ckpt, scale, shape, quant)
    groups = torch.arange(k) // bk if s.shape[1] > 1 else torch.zeros(k, dtype=torch.int64)
    return fp8_codes(ckpt, prefix, s.repeat_interleave(bn, dim=0)[:n], groups)
