"""Write a gpt-oss checkpoint with its MoE experts in MXFP4, the layout of OpenAI's gpt-oss-20b /
120b releases (transformers' `Mxfp4Config`, `quant_method: mxfp4`), from a float gpt-oss one:
no tool quantizes to it on the CPU (transformers quantizes with the `triton_kernels` hub package on
a GPU), so the tests write it here and check it against transformers' own reading of it.

Each layer's `mlp.experts.gate_up_proj` [E, K, N] (transformers' parameter: inputs first) is stored
as its transpose [E, N, K] in groups of 32 inputs: `gate_up_proj_blocks` uint8 [E, N, K / 32, 16],
two FP4 (E2M1) codes a byte, the even input in the low nibble (a sign bit and an index into 0, 0.5,
1, 1.5, 2, 3, 4, 6), and `gate_up_proj_scales` uint8 [E, N, K / 32], an E8M0 exponent per group
(2^(e - 127)); `down_proj` alike. The exponent is OCP MX's, floor(log2(amax)) - 2 (E2M1's largest
exponent), and each w / 2^that rounded to the nearest E2M1 value (ties to the even code), clamped
to +-6. Biases, attention, router, embeddings and the LM head stay as they are (the release's
`modules_to_not_convert`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from quant_formats import _finish, load_float_checkpoint

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [E, N, K] (K a multiple of 32) -> (blocks uint8 [E, N, K / 32, 16], exponents uint8
    [E, N, K / 32], the dequantized float32 [E, N, K])."""
    e, n, k = w.shape
    groups = w.float().reshape(e, n, k // 32, 32)
    amax = groups.abs().amax(dim=-1)
    p = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.full_like(amax, -127)).clamp(-127, 127)
    scale = torch.exp2(p)[..., None]
    x = (groups / scale).clamp(-6, 6)
    # nearest E2M1 magnitude, ties to the even index (the one whose mantissa bit is 0)
    dist = (x.abs()[..., None] - E2M1).abs()
    best = dist.min(dim=-1, keepdim=True).values
    index = torch.where(dist == best, torch.arange(8), 99).amin(dim=-1)  # the lower of two: even where tied
    tied = (dist == best).sum(dim=-1) > 1
    index = torch.where(tied & (index % 2 == 1), index + 1, index)
    codes = (index + 8 * (x < 0).long()).to(torch.uint8)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    values = torch.where(x < 0, -E2M1[index], E2M1[index]) * scale
    return blocks, (p + 127).to(torch.uint8), values.reshape(e, n, k)


def write_gpt_oss_mxfp4_checkpoint(src_dir: str | Path, out_dir: str | Path) -> dict[str, torch.Tensor]:
    """The checkpoint; returns the dequantized float32 experts under transformers' parameter names
    ([E, K, N], as the float checkpoint holds them)."""
    config, tensors = load_float_checkpoint(src_dir)
    out: dict[str, torch.Tensor] = {}
    deq: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            blocks, scales, values = mxfp4_quantize(t.transpose(1, 2))
            out[name + "_blocks"], out[name + "_scales"] = blocks, scales
            deq[name] = values.transpose(1, 2).contiguous()
        else:
            out[name] = t
    qconfig = {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
    _finish(Path(src_dir), Path(out_dir), config, qconfig, out, str(config.get("dtype", "float32")))
    return deq
