"""bitsandbytes checkpoints (transformers' `BitsAndBytesConfig` saved).

4-bit (`load_in_4bit=True`, e.g. the many `*-bnb-4bit` repositories): each quantized linear layer
stored under its module name as

- `weight`: uint8 [N * K / 2, 1], two 4-bit codes a byte over the weight [N, K] flattened row by
  row, the even element in the high nibble (with `bnb_4bit_quant_storage` another dtype, those
  bytes seen as it: e.g. bfloat16 [N * K / 4, 1]);
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

8-bit (`load_in_8bit=True`, LLM.int8): `weight` int8 [N, K], `SCB` float32 [N] (each row's
absmax: W = weight * SCB / 127), `weight_format` (0: rows as they are; bitsandbytes' tiled GPU
layouts are converted back before saving). Its layers quantize their activations too, with
outlier columns in float (`kernels/llm_int8.py`: `LlmInt8Linear`), on every device.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from batonlm.kernels.llm_int8 import OUTLIER_SCALE
from batonlm.model_runner.checkpoint import Checkpoint
from batonlm.model_runner.quantization.config import QuantizationError
from batonlm.model_runner.quantization.int_weights import IntWeights

STATE_SUFFIXES = ("quant_state.bitsandbytes__nf4", "quant_state.bitsandbytes__fp4")
ROW_SCALE = "SCB"  # an 8-bit layer's row scales, beside its `weight`
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
    stored = ckpt.get(p).contiguous()
    # `bnb_4bit_quant_storage` other than uint8 (bfloat16 for FSDP QLoRA): the same bytes, seen
    # as that dtype; read back as bytes (little-endian, as bitsandbytes reinterprets them).
    packed = (stored if stored.dtype == torch.uint8 else stored.view(torch.uint8)).reshape(-1).to(torch.int64)
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


def int4_weights(ckpt: Checkpoint, prefix: str, state: str) -> IntWeights:
    """A 4-bit layer whose rows hold whole blocks as the packed int layout's values: block b of
    row n is group b % (K / blocksize) of output column n; the codes unsigned, no zeros, the
    codebook the checkpoint's `quant_map`."""
    w = read(ckpt, prefix, state)
    n, k = w.codes.shape
    if k % w.blocksize:
        raise QuantizationError(f"{prefix}: blocks of {w.blocksize} cross its rows of {k} input features; it is "
                                "read dequantized")
    groups = k // w.blocksize
    scales = w.absmax[: n * groups].reshape(n, groups).t().contiguous()
    zeros = torch.zeros(groups, n, dtype=torch.int32)
    return IntWeights(w.codes.t().contiguous(), zeros, scales, torch.arange(k) // w.blocksize, 4, w.codebook)


def blocksize(ckpt: Checkpoint, state: str) -> int:
    return int(quant_state(ckpt, state)["blocksize"])


def dequantize(ckpt: Checkpoint, prefix: str, state: str) -> torch.Tensor:
    """The layer's weight [N, K] in float32."""
    w = read(ckpt, prefix, state)
    n, k = w.codes.shape
    scales = w.absmax.repeat_interleave(w.blocksize)[: n * k].reshape(n, k)
    return w.codebook[w.codes] * scales


def int8_members(names: set[str], prefix: str) -> tuple[str, ...] | None:
    """An 8-bit layer's tensors (weight, SCB, weight_format where saved), or None: not one."""
    if f"{prefix}.{ROW_SCALE}" not in names:
        return None
    return tuple(m for m in (f"{prefix}.weight", f"{prefix}.{ROW_SCALE}", f"{prefix}.weight_format") if m in names)


def int8_weight(ckpt: Checkpoint, prefix: str, members: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """An 8-bit layer's codes int8 [N, K] and row scales float32 [N] (its rows as saved: format 0)."""
    fmt = f"{prefix}.weight_format"
    if fmt in members and int(ckpt.get(fmt).reshape(-1)[0]) != 0:
        raise QuantizationError(f"{fmt} is {int(ckpt.get(fmt).reshape(-1)[0])}: bitsandbytes' tiled GPU layouts are "
                                "not read (transformers saves rows, format 0)")
    w, scb = ckpt.get(f"{prefix}.weight"), ckpt.get(f"{prefix}.{ROW_SCALE}").to(torch.float32).reshape(-1)
    if w.dtype != torch.int8 or w.dim() != 2 or scb.shape != (w.shape[0],):
        raise QuantizationError(f"{prefix}: an 8-bit layer is an int8 [N, K] weight with N float32 SCB; got "
                                f"{w.dtype} {list(w.shape)} and {list(scb.shape)}")
    return w, scb


def dequantize_int8(ckpt: Checkpoint, prefix: str, members: tuple[str, ...]) -> torch.Tensor:
    """W [N, K] float32 = weight * SCB * (1 / 127 in float32), bitsandbytes' own order."""
    w, scb = int8_weight(ckpt, prefix, members)
    return w * scb[:, None] * OUTLIER_SCALE
