"""Write an NVFP4A16 (or NVFP4 W4A4, or MXFP4A16) checkpoint (compressed-tensors'
`nvfp4-pack-quantized` / `mxfp4-pack-quantized`, the formats llm-compressor's schemes save) from a
float checkpoint, for tests at shapes the fixture
does not have (MoE experts); llm-compressor need not be installed. Not its numbers: it shares one
global scale among q/k/v and among gate/up, rounded to bfloat16; here each layer has its own.

Format (batonlm/model_runner/quantization/nvfp4.py reads it): every listed linear's weight [N, K]
with a float32 `weight_global_scale` = 448 * 6 / max |W| (FP8's largest over E2M1's: the
largest group scale lands on FP8's top), a float8 e4m3 `weight_scale` per 16 inputs of a row =
(the group's max |w| / 6) * global, rounded to FP8, and `weight_packed` uint8 [N, K / 2]: each w
divided by (scale / global), rounded to the nearest E2M1 value (0, 0.5, 1, 1.5, 2, 3, 4, 6; a
tie to the one with an even mantissa, as compressed-tensors rounds), its index in bits 0-2 and its sign in bit 3, two codes a byte, the even
element in the low nibble. The dequantized weight is value * (scale / global) in float32.
"""

from __future__ import annotations

from pathlib import Path

import torch
from quant_bnb import _write
from quant_formats import LINEARS, is_quantized_linear, load_float_checkpoint

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def nvfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] (K a multiple of 16) -> (packed uint8 [N, K / 2], scale float8 [N, K / 16], global
    float32 [1], the dequantized float32 [N, K])."""
    n, k = w.shape
    w = w.float()
    glob = (448.0 * 6.0 / w.abs().amax()).reshape(1)
    groups = w.view(n, k // 16, 16)
    scale = (groups.abs().amax(dim=2) / 6.0 * glob).clamp(max=448.0).to(torch.float8_e4m3fn)
    step = (scale.float() / glob)[:, :, None]  # compressed-tensors' dequantizing scale
    packed, value = _e2m1(groups / torch.where(step > 0, step, torch.ones_like(step)))
    return packed, scale, glob, (value * step).reshape(n, k)


def _e2m1(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Values v [N, G, group] (in steps) -> (their codes packed, uint8 [N, G * group / 2], the E2M1
    values they stand for): nearest, clamped to +-6, ties to even; sign in bit 3, the even
    element in the low nibble."""
    n = v.shape[0]
    mag = v.abs().clamp(max=6.0)
    mids = (E2M1[:-1] + E2M1[1:]) / 2
    index = torch.bucketize(mag, mids)  # the first midpoint >= the value: a tie takes the lower ...
    tie = (index < 7) & (mag == mids[index.clamp(max=6)]) & (index % 2 == 1)
    index = index + tie.long()  # ... unless that one's mantissa is odd (0.5, 1.5, 3, 6): to even, as IEEE
    codes = (index | torch.where(v < 0, 8, 0)).reshape(n, -1)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8), torch.where(v < 0, -E2M1[index], E2M1[index])


def write_nvfp4_checkpoint(src_dir: str | Path, out_dir: str | Path, linears: tuple[str, ...] = LINEARS,
                           input_global_scale: float | None = None) -> dict[str, torch.Tensor]:
    """The NVFP4A16 checkpoint of `src_dir`'s float weights (the projections named in `linears`);
    with `input_global_scale`, NVFP4 (W4A4): FP4 activations, every layer that input global
    scale (llm-compressor calibrates it: 448 * 6 / the largest input seen). Returns the
    dequantized float32 weights."""

    def quantize(name: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        packed, scale, glob, deq = nvfp4_quantize(w)
        prefix = name.removesuffix(".weight")
        stored = {prefix + ".weight_packed": packed, prefix + ".weight_scale": scale,
                  prefix + ".weight_global_scale": glob}
        if input_global_scale is not None:
            stored[prefix + ".input_global_scale"] = torch.tensor([input_global_scale])
        return stored, deq

    weights = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True,
               "dynamic": False, "scale_dtype": "torch.float8_e4m3fn"}
    qconfig = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "quantization_status": "compressed",
               "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                             "format": "nvfp4-pack-quantized"}}, "ignore": ["lm_head"]}
    if input_global_scale is not None:
        qconfig["config_groups"]["group_0"]["input_activations"] = {**weights, "dynamic": "local"}
    return _write(src_dir, out_dir, linears, qconfig, quantize)


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] (K a multiple of 32) -> (packed uint8 [N, K / 2], E8M0 exponents uint8 [N, K / 32],
    the dequantized float32 [N, K]): each group's scale the power of two 2^e with its largest |w|
    / 2^e at most 6 (E2M1's largest), the codes as for NVFP4."""
    n, k = w.shape
    groups = w.float().view(n, k // 32, 32)
    amax = groups.abs().amax(dim=2, keepdim=True).clamp(min=2.0**-120)
    e = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    step = torch.ldexp(torch.ones_like(amax), e.to(torch.int32))
    packed, value = _e2m1(groups / step)
    return packed, (e + 127).to(torch.uint8).reshape(n, k // 32), (value * step).reshape(n, k)


def write_mxfp4_checkpoint(src_dir: str | Path, out_dir: str | Path,
                           linears: tuple[str, ...] = LINEARS) -> dict[str, torch.Tensor]:
    """The MXFP4A16 checkpoint (`mxfp4-pack-quantized`) of `src_dir`'s float weights; returns the
    dequantized float32 weights (value * 2^(e - 127), exact)."""

    def quantize(name: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        packed, exponent, deq = mxfp4_quantize(w)
        prefix = name.removesuffix(".weight")
        return {prefix + ".weight_packed": packed, prefix + ".weight_scale": exponent}, deq

    weights = {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32, "symmetric": True,
               "dynamic": False, "scale_dtype": "torch.uint8"}
    qconfig = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "quantization_status": "compressed",
               "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                             "format": "mxfp4-pack-quantized"}}, "ignore": ["lm_head"]}
    return _write(src_dir, out_dir, linears, qconfig, quantize)


# ModelOpt shares one per-tensor scale among the layers of one input (the max of their amax).
_FUSED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up",
          "w1": "gate_up", "w3": "gate_up"}


def write_modelopt_nvfp4_checkpoint(src_dir: str | Path, out_dir: str | Path, linears: tuple[str, ...] = LINEARS,
                                    input_scale: float | None = None) -> dict[str, torch.Tensor]:
    """The W4A16_NVFP4 checkpoint in NVIDIA ModelOpt's layout (what `export_hf_checkpoint` writes
    for `mtq.W4A16_NVFP4_CFG`; byte for byte the `modelopt-w4a16-nvfp4` fixture's weights) of
    `src_dir`'s float weights: every listed linear's `weight_scale_2` = amax / (6 * 448), amax the
    largest |w| of the layer and of those sharing its input (q/k/v, gate/up: ModelOpt's export
    gives them one); `weight_scale` per 16 inputs = fp8(group amax / (6 * scale_2)) clamped to
    [2^-9, 448]; `weight` the codes of w / (scale * scale_2) (nearest, ties to even), packed as
    NVFP4's. With `input_scale`, ModelOpt's NVFP4 (W4A4): every layer that FP4 activation scale
    (ModelOpt calibrates it: amax / (6 * 448)). Returns the dequantized float32 weights, value *
    (scale * scale_2)."""
    _, tensors = load_float_checkpoint(src_dir)
    amax: dict[str, torch.Tensor] = {}
    for name, w in tensors.items():
        if is_quantized_linear(name, linears):
            key = _fused_key(name)
            amax[key] = torch.maximum(amax.get(key, torch.tensor(0.0)), w.float().abs().amax())

    def quantize(name: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        n, k = w.shape
        scale_2 = amax[_fused_key(name)] / (6.0 * 448.0)
        groups = w.float().view(n, k // 16, 16)
        scale = (groups.abs().amax(dim=2) / (6.0 * scale_2))
        scale = torch.where(scale == 0, torch.ones_like(scale), scale).clamp(2.0**-9, 448.0).to(torch.float8_e4m3fn)
        step = (scale.float() * scale_2)[:, :, None]
        packed, value = _e2m1(groups / step)
        prefix = name.removesuffix(".weight")
        stored = {name: packed, prefix + ".weight_scale": scale, prefix + ".weight_scale_2": scale_2.clone()}
        if input_scale is not None:
            stored[prefix + ".input_scale"] = torch.tensor(input_scale)
        return stored, (value * step).reshape(n, k)

    algo = "W4A16_NVFP4" if input_scale is None else "NVFP4"
    qconfig = {"quant_method": "modelopt", "quant_algo": algo, "group_size": 16,
               "config_groups": {"group_0": {"weights": {"dynamic": False, "num_bits": 4, "type": "float",
                                                         "group_size": 16}, "targets": ["Linear"]}},
               "ignore": ["lm_head"], "producer": {"name": "modelopt"}}
    return _write(src_dir, out_dir, linears, qconfig, quantize)


def _fused_key(name: str) -> str:
    """`name` with its projection replaced by the fused one it shares an input with (itself else)."""
    module, proj, leaf = name.rsplit(".", 2)
    return f"{module}.{_FUSED.get(proj, proj)}.{leaf}"
