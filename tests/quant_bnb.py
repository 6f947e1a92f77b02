"""Write bitsandbytes checkpoints from a float checkpoint, for tests and benchmarks at shapes the
fixtures do not have (bitsandbytes need not be installed): 4-bit NF4 (what transformers'
`BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")` saves, without double
quantization) and 8-bit (`load_in_8bit=True`, LLM.int8).

NF4 (batonlm/model_runner/quantization/bnb.py reads it): every decoder linear's weight [N, K]
flattened row by row, cut into blocks of `blocksize` elements; a block's scale is its largest
|w| (`absmax`, float32); each element is w times the reciprocal of that scale (float32, clamped
to [-1, 1]), coded as the NF4 value nearest it (a value on the midpoint of two takes the lower);
two codes a byte, the even element in the high nibble. Checked against bitsandbytes' own
checkpoint of the same weights (the `bnb-nf4` / `bnb-fp4` fixtures: the same codes and scales,
tests/unit/test_quant_formats.py).

8-bit: every decoder linear's weight taken in float16; `SCB` (float32 [N]) its rows' largest |w|;
`weight` int8 [N, K] = w * (127 * (1 / SCB)) (the reciprocal and the products rounded to
float32) rounded half to even; `weight_format` 0 (rows). The `bnb-int8` fixture's bytes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from quant_formats import LINEARS, _finish, is_quantized_linear, load_float_checkpoint

# NF4's 16 values (QLoRA's normal-quantile table, as bitsandbytes stores it in `quant_map`).
NF4 = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
       0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0)


def nf4_quantize(w: torch.Tensor, blocksize: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (codes uint8 [N * K], absmax float32 [ceil(N * K / blocksize)])."""
    flat = w.reshape(-1).float()
    n = flat.numel()
    blocks = -(-n // blocksize)
    padded = torch.nn.functional.pad(flat, (0, blocks * blocksize - n)).view(blocks, blocksize)
    absmax = padded.abs().amax(dim=1)
    scaled = (padded * (1.0 / absmax.clamp(min=1e-38))[:, None]).clamp(-1, 1).reshape(-1)[:n]
    table = torch.tensor(NF4, dtype=torch.float32)
    midpoints = (table[:-1] + table[1:]) / 2
    codes = torch.bucketize(scaled, midpoints)  # the first midpoint >= the value: a tie takes the lower code
    return codes.to(torch.uint8), absmax


def _write(src_dir: str | Path, out_dir: str | Path, linears: tuple[str, ...], qconfig: dict,
           quantize: Callable[[str, torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]],
           ) -> dict[str, torch.Tensor]:
    """`src_dir`'s checkpoint with each projection named in `linears` replaced by the tensors
    `quantize(name, w)` stores for it, the rest as they are, under `qconfig`; returns the
    dequantized float32 weights `quantize` gives beside them."""
    src = Path(src_dir)
    config, tensors = load_float_checkpoint(src)
    result: dict[str, torch.Tensor] = {}
    deq: dict[str, torch.Tensor] = {}
    for name, w in tensors.items():
        if is_quantized_linear(name, linears):
            stored, deq[name] = quantize(name, w)
            result.update(stored)
        else:
            result[name] = w
    _finish(src, Path(out_dir), config, qconfig, result, str(next(iter(tensors.values())).dtype).removeprefix("torch."))
    return deq


def write_bnb4_checkpoint(src_dir: str | Path, out_dir: str | Path, blocksize: int = 64,
                          linears: tuple[str, ...] = LINEARS) -> dict[str, torch.Tensor]:
    """The NF4 checkpoint of `src_dir`'s float weights (the projections named in `linears`: a
    MoE's experts too where they are listed); returns the dequantized float32 weights
    (NF4[code] * absmax, one float32 product, as bitsandbytes dequantizes)."""
    table = torch.tensor(NF4, dtype=torch.float32)

    def quantize(name: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        n, k = w.shape
        codes, absmax = nf4_quantize(w, blocksize)
        even = torch.nn.functional.pad(codes, (0, codes.numel() % 2))
        state = {"quant_type": "nf4", "blocksize": blocksize, "dtype": "float32", "shape": [n, k]}
        stored = {name: ((even[0::2] << 4) | even[1::2]).unsqueeze(1), name + ".absmax": absmax,
                  name + ".quant_map": table.clone(),  # (safetensors refuses shared storage)
                  name + ".quant_state.bitsandbytes__nf4": torch.tensor(list(json.dumps(state).encode()),
                                                                        dtype=torch.uint8)}
        return stored, (table[codes.long()] * absmax.repeat_interleave(blocksize)[: n * k]).view(n, k)

    qconfig = {"quant_method": "bitsandbytes", "load_in_4bit": True, "_load_in_4bit": True, "load_in_8bit": False,
               "_load_in_8bit": False, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": False,
               "bnb_4bit_quant_storage": "uint8", "bnb_4bit_compute_dtype": "float32"}
    return _write(src_dir, out_dir, linears, qconfig, quantize)


def write_int8_checkpoint(src_dir: str | Path, out_dir: str | Path, threshold: float = 6.0,
                          linears: tuple[str, ...] = LINEARS) -> dict[str, torch.Tensor]:
    """The 8-bit (LLM.int8) checkpoint of `src_dir`'s float weights; returns the dequantized
    float32 weights (weight * SCB * (1 / 127 in float32), bitsandbytes' own order)."""

    def quantize(name: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        w16 = w.to(torch.float16).float()
        scb = w16.abs().amax(dim=1)
        codes = torch.round(w16 * (scb.reciprocal() * 127.0)[:, None]).to(torch.int8)
        prefix = name.removesuffix(".weight")
        stored = {name: codes, prefix + ".SCB": scb, prefix + ".weight_format": torch.tensor(0, dtype=torch.uint8)}
        return stored, codes * scb[:, None] * torch.tensor(1 / 127, dtype=torch.float32)

    qconfig = {"quant_method": "bitsandbytes", "load_in_8bit": True, "_load_in_8bit": True, "load_in_4bit": False,
               "_load_in_4bit": False, "llm_int8_threshold": threshold, "llm_int8_has_fp16_weight": False,
               "llm_int8_skip_modules": None, "llm_int8_enable_fp32_cpu_offload": False}
    return _write(src_dir, out_dir, linears, qconfig, quantize)
