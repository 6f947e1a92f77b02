"""Write an MXFP8 (or MXFP8A16) checkpoint in compressed-tensors' `mxfp8-quantized` layout (what
llm-compressor's MXFP8 / MXFP8A16 schemes save), or ModelOpt's FP8_PB_WO, from a float checkpoint,
for benchmarks and tests at shapes the fixtures do not have; the tools need not be installed.
Byte for byte the `mxfp8` / `modelopt-fp8-pb-wo` fixtures' weights from their source
(tests/unit/test_quant_formats.py).

Each listed linear's weight [N, K] (K a multiple of 32), in bfloat16 as llm-compressor loads it:
per group of 32 inputs of a row, p = floor(log2(amax)) (one more where amax's mantissa is 1.75
or more: compressed-tensors rounds amax to a power of two by its float bits), the uint8
`weight_scale` 127 + p - 8 clamped to [0, 255] (E8M0); the float8 e4m3 `weight` = w / 2^(p - 8)
(exact) clamped to +-448, rounded to nearest even. With `activations`, the config's
`input_activations` quantize each input alike at run time (MXFP8; else MXFP8A16, weight-only).
"""

from __future__ import annotations

from pathlib import Path

import torch
from quant_bnb import _write
from quant_formats import LINEARS


def mxfp8_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> (codes float8_e4m3fn [N, K], exponents uint8 [N, K / 32], the dequantized
    float32 [N, K], exact)."""
    n, k = w.shape
    groups = w.to(torch.bfloat16).float().view(n, k // 32, 32)
    mantissa, exponent = torch.frexp(groups.abs().amax(dim=2))
    p = exponent - 1 + (mantissa >= 0.875).to(exponent.dtype)
    biased = torch.where(mantissa > 0, 127 + p - 8, torch.zeros_like(p)).clamp(0, 255)
    step = torch.ldexp(torch.ones(biased.shape), biased - 127)[:, :, None]
    codes = (groups / step).clamp(-448, 448).to(torch.float8_e4m3fn)
    return codes.reshape(n, k), biased.to(torch.uint8), (codes.float() * step).reshape(n, k)


def write_mxfp8_checkpoint(src_dir: str | Path, out_dir: str | Path, activations: bool = True,
                           linears: tuple[str, ...] = LINEARS) -> dict[str, torch.Tensor]:
    """The checkpoint; returns the dequantized float32 weights (value * 2^(e - 127))."""

    def quantize(name: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        codes, exponents, deq = mxfp8_quantize(w)
        return {name: codes, name.removesuffix(".weight") + ".weight_scale": exponents}, deq

    mx = {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 32, "symmetric": True,
          "scale_dtype": "torch.uint8", "zp_dtype": None, "block_structure": None, "actorder": None}
    group = {"targets": ["Linear"], "format": "mxfp8-quantized", "output_activations": None,
             "weights": {**mx, "dynamic": False, "observer": "memoryless_minmax"},
             "input_activations": {**mx, "dynamic": True, "observer": None} if activations else None}
    qconfig = {"quant_method": "compressed-tensors", "format": "mxfp8-quantized", "quantization_status": "compressed",
               "config_groups": {"group_0": group}, "ignore": ["lm_head"], "kv_cache_scheme": None,
               "sparsity_config": {}, "transform_config": {}, "global_compression_ratio": None}
    return _write(src_dir, out_dir, linears, qconfig, quantize)


def write_modelopt_fp8_pb_wo_checkpoint(src_dir: str | Path, out_dir: str | Path,
                                        linears: tuple[str, ...] = LINEARS) -> dict[str, torch.Tensor]:
    """NVIDIA ModelOpt's FP8_PB_WO checkpoint (`mtq.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG` exported;
    byte for byte the `modelopt-fp8-pb-wo` fixture's weights) of `src_dir`'s float weights, in
    bfloat16: per 128x128 block (N and K multiples of 128) the float32 scale amax / 448, stored
    [N / 128, 1, K / 128, 1]; the codes w / scale rounded to e4m3; inputs float. Returns the
    dequantized float32 weights (code * scale)."""

    def quantize(name: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        n, k = w.shape
        blocks = w.to(torch.bfloat16).float().view(n // 128, 128, k // 128, 128)
        scale = blocks.abs().amax(dim=(1, 3), keepdim=True) / 448.0
        codes = (blocks / scale).to(torch.float8_e4m3fn)
        return ({name: codes.reshape(n, k), name.removesuffix(".weight") + ".weight_scale": scale},
                (codes.float() * scale).reshape(n, k))

    qconfig = {"quant_method": "modelopt", "quant_algo": "fp8_pb_wo", "ignore": ["lm_head", "model.embed_tokens"],
               "producer": {"name": "modelopt"}}
    return _write(src_dir, out_dir, linears, qconfig, quantize)
