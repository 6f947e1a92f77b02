"""NVFP4 activations (compressed-tensors' NVFP4 scheme, W4A4): a layer's input quantized to FP4
E2M1 per token and group of 16 and back, as compressed-tensors computes it; the layer then
multiplies those values by its NVFP4 weights (the codebook GEMM of `quant.py`). Torch operations
on every device (no host synchronisation).

For x [M, K] (K a multiple of 16) and the layer's calibrated `input_global_scale` g (float32):
- a group's scale s = fp8(g * (amax / 6)): its largest |x| over E2M1's largest, times g, rounded
  to float8 e4m3 (clamped to +-448; each operation rounded to float32, the division by a tensor 6
  as compressed-tensors divides by its range); a scale of 0 becomes 0.125 (float8 e4m3's eps, its
  substitute for a zero scale);
- step = s / g; each value x / step, clamped to [-6, 6], rounded to the nearest E2M1 value
  (0, 0.5, 1, 1.5, 2, 3, 4, 6; a tie to the one with an even mantissa), times step.

NVIDIA ModelOpt's NVFP4 (`modelopt_nvfp4_fake_quant`) stores the layer's per-tensor scale the other
way up, `input_scale` t = amax / (6 * 448) (g = 1 / t), and quantizes a tensor in another order
(`NVFP4QTensor.quantize`, what its export quantizes the weights with): s = fp8(amax / (6 * t))
clamped to [2^-9, 448]; step = s * t; then the same rounding. The two orders give steps a float32
ulp apart here and there (a value at a rounding tie would round differently), so each format's
layers run its own arithmetic.
"""

from __future__ import annotations

import torch

from batonlm.kernels._checks import check_2d, check_scale, fail

GROUP = 16
E2M1_MAX = 6.0
FP8_MAX = 448.0
ZERO_SCALE = 0.125  # compressed-tensors' eps for a float8 e4m3 scale that rounds to 0
MODELOPT_MIN_SCALE = 2.0**-9  # ModelOpt clamps a group's float8 scale to float8 e4m3's smallest
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def round_e2m1(v: torch.Tensor) -> torch.Tensor:
    """float32 v, clamped to [-6, 6], rounded to the nearest E2M1 value (ties to even). E2M1's
    values are multiples of 0.5 below 2, of 1 from 2 to 4 and of 2 from 4 to 6: the magnitude
    divided by its range's spacing (a power of two: exact), rounded half to even (an even multiple
    is an even mantissa: 0, 1, 2, 4) and multiplied back. Scalars only (no table copied to the
    device: a CUDA graph captures it)."""
    mag = v.abs().clamp(max=_E2M1[-1])
    step = torch.where(mag < 2.0, 0.5, torch.where(mag < 4.0, 1.0, 2.0))
    value = torch.round(mag / step) * step
    return torch.where(v < 0, -value, value)


def _groups(x: torch.Tensor, scale: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] checked, in float32 as [M, K / 16, 16]; each group's largest |x|; the scale, []
    or each row's [M, 1, 1]."""
    check_2d(x, "x")
    if not x.is_floating_point():
        raise fail("x", "a floating-point tensor", x.dtype)
    m, k = x.shape
    if k % GROUP:
        raise fail("x", f"a multiple of {GROUP} columns (NVFP4's groups)", k)
    check_scale(scale, name, [(), (1,), (m,)])
    xf = x.float().view(m, k // GROUP, GROUP)
    return xf, xf.abs().amax(dim=2, keepdim=True), scale.reshape(()) if scale.numel() == 1 else scale.view(m, 1, 1)


def nvfp4_fake_quant(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] quantized to NVFP4 per token and group of 16 with `global_scale` (float32 [1] or
    [], or [M]: each row's own, a MoE's routed rows each by its expert's) and back, in x's dtype
    (computed in float32): compressed-tensors' arithmetic."""
    xf, amax, g = _groups(x, global_scale, "global_scale")
    scale = (g * (amax / torch.full_like(amax, E2M1_MAX))).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    scale = torch.where(scale == 0, torch.full_like(scale, ZERO_SCALE), scale)
    step = scale / g
    return (round_e2m1(xf / step) * step).view(x.shape).to(x.dtype)


def modelopt_nvfp4_fake_quant(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] quantized to NVFP4 per token and group of 16 with ModelOpt's `input_scale`
    (float32 [1] or [], or [M] per row; amax / (6 * 448)) and back, in x's dtype: ModelOpt's
    arithmetic."""
    xf, amax, t = _groups(x, input_scale, "input_scale")
    scale = (amax / (t * E2M1_MAX)).clamp(MODELOPT_MIN_SCALE, FP8_MAX).to(torch.float8_e4m3fn).float()
    step = scale * t
    return (round_e2m1(xf / step) * step).view(x.shape).to(x.dtype)


# A layer's FP4 activation quantization by the format whose arithmetic it follows.
FP4_INPUTS = {"compressed-tensors": nvfp4_fake_quant, "modelopt": modelopt_nvfp4_fake_quant}
