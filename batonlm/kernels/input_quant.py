"""A layer's input quantized and back (fake-quantized) before a weight-only GEMM: the activation
half of a checkpoint whose weights the packed int layout holds (`PackedIntLinear`, `Int4Experts`)
but whose config quantizes its inputs too, as its tool computes that:

- `fp8`: FP8 e4m3 per token, scale = amax / 448 (llm-compressor's W4AFP8: int4 weights);
- `int8` / `int8-asym`: int8 per token, symmetric (scale = amax / 127.5) or with a zero point
  (compressed-tensors' W4A8, as `kernels/int8.py` defines them);
- `mxfp8-compressed-tensors` / `mxfp8-modelopt`: MXFP8 per 32 inputs in that tool's exponent
  rule (`kernels/mxfp8.py`); `mxfp4-compressed-tensors`: MXFP4 alike (`kernels/mxfp4.py`).

Each takes rows [M, K] and returns them in their dtype, every value the quantized one: the
codes times their scale in float32, rounded once to the dtype (exact in float32), what the tools'
`fake_quantize` gives. Which one a layer takes is a key of `INPUT_QUANTS`."""

from __future__ import annotations

from collections.abc import Callable

import torch

from batonlm.kernels.int8 import per_token_quant_int8, per_token_quant_int8_asym
from batonlm.kernels.mxfp4 import ct_mxfp4_fake_quant
from batonlm.kernels.mxfp8 import MX_INPUTS
from batonlm.kernels.quant import per_token_quant_fp8


def fp8_per_token(x: torch.Tensor) -> torch.Tensor:
    codes, scale = per_token_quant_fp8(x)
    return (codes.to(torch.float32) * scale).to(x.dtype)


def int8_per_token(x: torch.Tensor) -> torch.Tensor:
    codes, scale = per_token_quant_int8(x)
    return (codes.to(torch.float32) * scale).to(x.dtype)


def int8_per_token_asym(x: torch.Tensor) -> torch.Tensor:
    codes, scale, zero = per_token_quant_int8_asym(x)
    return ((codes.to(torch.float32) - zero) * scale).to(x.dtype)


INPUT_QUANTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "fp8": fp8_per_token, "int8": int8_per_token, "int8-asym": int8_per_token_asym,
    **{f"mxfp8-{tool}": quant for tool, quant in MX_INPUTS.items()},
    "mxfp4-compressed-tensors": ct_mxfp4_fake_quant,
}
