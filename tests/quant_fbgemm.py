"""Write FBGEMM FP8 checkpoints (transformers' `FbgemmFp8Config`, `quant_method: fbgemm_fp8`: Meta's
Llama 3.1 405B and Llama 4 FP8 releases) from a float checkpoint, for tests. No tool writes one
on the CPU (transformers quantizes with FBGEMM's CUDA `quantize_fp8_per_row`), so this helper
writes its layout and arithmetic:

- each converted linear: `weight` float8 e4m3 [N, K] and `weight_scale` float32 [N, 1], FBGEMM's
  per-row quantization: scale = max(amax / 448, 1 / (448 * 512)), codes = w / scale clamped to
  +-448 and rounded to e4m3 (transformers' `FbgemmFp8Quantize` stores the scale as [N, 1]);
- `modules_to_not_convert`: modules left in float (Meta's releases keep attention and the first
  and last layers so), their `weight` as it is;
- the config: `{"quant_method": "fbgemm_fp8", "activation_scale_ub": ub, "modules_to_not_convert": [...]}`;
  run time quantizes each linear's input per token with its amax capped at `ub`.

`fbgemm_activation` is that activation quantization (its fake-quantized values), for references.
"""

from __future__ import annotations

from pathlib import Path

import torch
from quant_formats import _finish, is_quantized_linear, load_float_checkpoint

FP8_MAX = 448.0
MIN_SCALE = 1.0 / (448.0 * 512.0)


def fbgemm_quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (codes float8_e4m3fn [N, K], scale float32 [N, 1])."""
    w = w.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / torch.tensor(FP8_MAX)).clamp(min=MIN_SCALE)
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def fbgemm_activation(x: torch.Tensor, ub: float) -> torch.Tensor:
    """x [..., K] quantized per token as FBGEMM does at run time (amax capped at ub), dequantized."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp(max=ub)
    scale = (amax / torch.tensor(FP8_MAX)).clamp(min=MIN_SCALE)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale


def write_fbgemm_fp8_checkpoint(src_dir: str | Path, out_dir: str | Path, ub: float = 1200.0,
                                not_convert: tuple[str, ...] = ("lm_head",)) -> dict[str, torch.Tensor]:
    """The checkpoint, its float tensors in bfloat16 (Meta's dtype); `not_convert`: module names
    left in float (a linear whose name starts with one). Returns the converted linears'
    dequantized float32 weights (codes * scale)."""
    src, out = Path(src_dir), Path(out_dir)
    config, tensors = load_float_checkpoint(src)
    result: dict[str, torch.Tensor] = {}
    deq: dict[str, torch.Tensor] = {}
    for name, w in tensors.items():
        module = name.removesuffix(".weight")
        if not is_quantized_linear(name) or any(module == m or module.startswith(m + ".") for m in not_convert):
            result[name] = w.to(torch.bfloat16) if w.is_floating_point() else w
            continue
        q, scale = fbgemm_quantize_rows(w.to(torch.bfloat16))
        result[name], result[module + ".weight_scale"] = q, scale
        deq[name] = q.float() * scale
    qconfig = {"quant_method": "fbgemm_fp8", "activation_scale_ub": ub, "modules_to_not_convert": list(not_convert)}
    _finish(src, out, config, qconfig, result, "bfloat16")
    return deq
