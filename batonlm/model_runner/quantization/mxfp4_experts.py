"""gpt-oss's MXFP4 experts (`quant_method: mxfp4`, transformers' `Mxfp4Config`: OpenAI's
gpt-oss-20b / 120b releases). Each MoE layer's stacked expert weights are stored under
transformers' parameter name with a suffix:

- `<experts>.gate_up_proj_blocks`: uint8 [E, N, K / 32, 16], the transpose of transformers'
  [E, K, N] parameter in groups of 32 inputs, two FP4 (E2M1) codes a byte, the even input in the
  low nibble (NVFP4's and MXFP4's code: a sign bit and an index into 0 .. 6, `nvfp4.CODEBOOK`);
- `<experts>.gate_up_proj_scales`: uint8 [E, N, K / 32], an E8M0 exponent per group, 2^(e - 127);
- `down_proj_blocks` / `down_proj_scales` alike. Everything else (attention, router, biases,
  embeddings, the LM head: the release's `modules_to_not_convert`) is float.

gpt-oss runs on transformers' modeling code (the fallback), so the dequantizing view shows each
pair as the float parameter transformers' model takes, [E, K, N] in float32: value * 2^(e - 127),
exact."""

from __future__ import annotations

import torch

from batonlm.kernels.int4 import e8m0_scales
from batonlm.model_runner.checkpoint import Checkpoint
from batonlm.model_runner.quantization.nvfp4 import CODEBOOK
from batonlm.model_runner.quantization.quant_config import QuantizationError

GROUP = 32


def find(names: set[str]) -> dict[str, tuple[str, str]]:
    """transformers' parameter name -> (its blocks, its scales), for each pair in the checkpoint."""
    out = {}
    for name in names:
        if name.endswith("_blocks"):
            param = name.removesuffix("_blocks")
            if param + "_scales" not in names:
                raise QuantizationError(f"mxfp4 tensor {name} has no {param}_scales beside it")
            out[param] = (name, param + "_scales")
    return out


def shape(ckpt: Checkpoint, blocks: str) -> tuple[int, int, int]:
    """transformers' [E, K, N] of the blocks' [E, N, K / 32, 16]."""
    e, n, groups, half = ckpt.shape(blocks)
    return e, groups * 2 * half, n


def dequantize(ckpt: Checkpoint, blocks: str, scales: str) -> torch.Tensor:
    """The parameter [E, K, N] in float32."""
    codes, exponents = ckpt.get(blocks), ckpt.get(scales)
    if codes.dtype != torch.uint8 or exponents.dtype != torch.uint8 or codes.dim() != 4 or \
            tuple(exponents.shape) != tuple(codes.shape[:3]) or codes.shape[3] * 2 != GROUP:
        raise QuantizationError(f"mxfp4 tensors {blocks} ({codes.dtype} {list(codes.shape)}) and {scales} "
                                f"({exponents.dtype} {list(exponents.shape)}) are not uint8 [E, N, K / 32, 16] "
                                "codes and [E, N, K / 32] exponents")
    e, n, groups, half = codes.shape
    out = torch.empty(e, groups * GROUP, n, dtype=torch.float32)
    for i in range(e):  # one expert at a time: gpt-oss-120b's are 128 of [5760, 2880] in one tensor
        nibbles = torch.stack([codes[i] & 15, codes[i] >> 4], dim=-1).reshape(n, groups, GROUP)  # the low nibble first
        values = CODEBOOK[nibbles.int()] * e8m0_scales(exponents[i])[..., None]
        out[i] = values.reshape(n, groups * GROUP).t()
    return out
