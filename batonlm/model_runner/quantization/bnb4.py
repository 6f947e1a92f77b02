"""bitsandbytes 4-bit checkpoints (transformers' `BitsAndBytesConfig(load_in_4bit=True)` saved,
e.g. the many `*-bnb-4bit` repositories): each quantized linear layer stored under its module
name as

- `weight`: uint8 [N * K / 2, 1], two 4-bit codes a byte over the weight [N, K] flattened row by
  row, the even element in the high nibble;
- `weight.quant_map`: float32 [16], the value of each code (NF4's or FP4's table);
- `weight.absmax`: one scale per block of `blocksize` consecutive elements: float32, or with
  double quantization (`bnb_4bit_use_double_quant`) uint8 codes into `weight.nested_quant_map`
  [256] times `weight.nested_absmax` (one per `nested_blocksize` scales), plus `nested_offset`;
- `weight.quant_state.bitsandbytes__nf4` (or `__fp4`): uint8, the JSON of the rest (quant_type,
  blocksize, shape, dtype, nested_blocksize, nested_offset).

W = quant_map[code] * absmax[element // blocksize], in float32 (bitsandbytes'
`dequantize_4bit`, to the bit: tests/unit/test_quantized_checkpoints.py). Where a row holds whole
blocks (K a multiple of blocksize, as in every model's projections), a block is a group of
`blocksize` input features of one output row: the packed int layout with a codebook
(`formats.int_weights`), kept packed where integer formats are (CUDA); else dequantized on load.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from batonlm.model_runner.checkpoint import Checkpoint
from batonlm.model_runner.quantization.config import QuantizationError

STATE_SUFFIXES = ("quant_state.bitsandbytes__nf4", "quant_state.bitsandbytes__fp4")
_PARTS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")


def state_name(names: set[str], prefix: str) -> str | None:
    """The quant-state tensor of the 4-bit layer whose packed weight is `prefix`.weight, if any."""
    return next((f"{prefix}.weight.{s}" for s in STATE_SUFFIXES if f"{prefix}.weight.{s}" in names), None)


def members(names: set[str], prefix: str, state: str) -> tuple[str, ...]:
    """The checkpoint tensors the layer consumes."""
    return (f"{prefix}.weight", state, *(f"{prefix}.weight.{p}" for p in _PARTS if f"{prefix}.weight.{p}" in names))


def quant_state(ckpt: Checkpoint, state: str) -> dict[str, Any]:
    raw = bytes(ckpt.get(state).to(torch.uint8).tolist())
    try:
        qs = json.loads(raw.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise QuantizationError(f"{state} is not bitsandbytes' JSON quant state: {e}") from None
    if not isinstance(qs, dict) or not isinstance(qs.get("shape"), list) or len(qs["shape"]) != 2:
        raise QuantizationError(f"{state} has no 2-D weight shape")
    return qs


@dataclass(frozen=True)
class Bnb4Weights:
    """A layer's codes [N, K] (int64, 0..15), its float32 scales, one per block of `blocksize`
    consecutive elements of the flattened weight (the double-quantized ones dequantized), and
    its codebook (float32 [16])."""

    codes: torch.Tensor
    absmax: torch.Tensor
    codebook: torch.Tensor
    blocksize: int


def read(ckpt: Checkpoint, prefix: str, state: str) -> Bnb4Weights:
    qs = quant_state(ckpt, state)
    n, k = (int(v) for v in qs["shape"])
    p = f"{prefix}.weight"
    packed = ckpt.get(p).reshape(-1).to(torch.int64)
    if packed.numel() * 2 < n * k:
        raise QuantizationError(f"{p}: {packed.numel()} bytes cannot hold a {n}x{k} weight at 4 bits")
    codes = torch.stack([packed >> 4, packed & 15], dim=1).reshape(-1)[: n * k].reshape(n, k)
    absmax = ckpt.get(p + ".absmax")
    if absmax.dtype == torch.uint8:  # double quantization: the scales' own 8-bit codes and scales
        nested = ckpt.get(p + ".nested_absmax").to(torch.float32)
        per = nested.repeat_interleave(int(qs["nested_blocksize"]))[: absmax.numel()]
        absmax = ckpt.get(p + ".nested_quant_map").to(torch.float32)[absmax.long()] * per + float(qs["nested_offset"])
    return Bnb4Weights(codes, absmax.to(torch.float32), ckpt.get(p + ".quant_map").to(torch.float32),
                       int(qs["blocksize"]))


def blocksize(ckpt: Checkpoint, state: str) -> int:
    return int(quant_state(ckpt, state)["blocksize"])


def dequantize(ckpt: Checkpoint, prefix: str, state: str) -> torch.Tensor:
    """The layer's weight [N, K] in float32."""
    w = read(ckpt, prefix, state)
    n, k = w.codes.shape
    scales = w.absmax.repeat_interleave(w.blocksize)[: n * k].reshape(n, k)
    return w.codebook[w.codes] * scales
