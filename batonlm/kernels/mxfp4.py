"""MXFP4 activations (compressed-tensors' MXFP4 scheme, W4A4 with MXFP4 weights): a layer's input
quantized to FP4 E2M1 per token and group of 32 consecutive inputs with a power-of-two scale (an
E8M0 exponent) and back, as compressed-tensors computes it (`generate_mx_scales`, then
`fake_quantize`): the group's amax rounded to a power of two 2^p by its float bits (up where its
mantissa is 1.75 or more), e = p - 2 (E2M1's largest power of two, 2^2), 127 + e clamped to
[0, 255] (amax 0: e = -127); each value x / 2^e (exact), clamped to [-6, 6], rounded to the nearest
E2M1 value (ties to the even mantissa, `fp4.round_e2m1`), times 2^e. MXFP8's rule with E2M1 in
place of e4m3 (kernels/mxfp8.py: its grouping and exponent rule, shared). Torch operations on every device (no host synchronisation)."""

from __future__ import annotations

import torch

from batonlm.kernels.fp4 import round_e2m1
from batonlm.kernels.mxfp8 import ct_mx_exponents, mx_groups


def ct_mxfp4_fake_quant(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] quantized to MXFP4 per group of 32 along K (the last group zero-padded) and
    back, in x's dtype (computed in float32)."""
    xg, k = mx_groups(x)
    e = ct_mx_exponents(xg, 2)[..., None]
    y = torch.ldexp(round_e2m1(torch.ldexp(xg, -e)), e)
    return y.reshape(*x.shape[:-1], -1)[..., :k].to(x.dtype)
