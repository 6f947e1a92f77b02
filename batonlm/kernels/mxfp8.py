"""MXFP8 activations (the OCP microscaling format with FP8 e4m3 elements): each group of 32
consecutive inputs of a row shares a power-of-two scale 2^e (an E8M0 exponent, e in [-127, 127]);
its values x / 2^e are rounded to e4m3 (clamped to +-448). Dividing by a power of two is exact,
so e4m3's rounding is the only one. The tools write the choice of e from the group's amax
differently, and a layer quantizes its inputs as its checkpoint's tool does (`MX_INPUTS`):

- ModelOpt (`MXFP8QTensor`): e = ceil(log2(amax / 448)), the least e whose range holds amax (amax
  / 448 a float32 quotient; amax 0: e = -127), clamped to [-127, 127]. ModelOpt takes the log in
  float32 (`torch.log2`); here the ceiling is exact (`frexp`), the same e except where amax / 448
  lies within a float32 log's rounding of a power of two.
- compressed-tensors (`generate_mx_scales`): amax rounded to a power of two 2^p (up where its
  mantissa is 1.75 or more: its float bits plus a quarter of the exponent step, the mantissa
  masked off), e = p - 8 (e4m3's largest power of two, 2^8), the biased exponent clamped to
  [0, 255] (amax 0: 2^-127); the largest value lands in [224, 448), never saturating.

Both give e = p - 8 for a mantissa under 1.75 and p - 7 above it; at exactly 1.75 * 2^p
(amax / 448 a power of two) ModelOpt keeps p - 8 (amax lands on 448) and compressed-tensors takes
p - 7, so a group whose largest input is such a value quantizes differently.

Each function takes x [..., K] and returns the dequantized values (x's dtype; computed in
float32, the values exact there): what a W8A8 MXFP8 layer multiplies its weights with. The torch
reference (~10 elementwise passes) beside a Triton twin (`_triton_mxfp8.py`: one pass, the
exponent read off the float bits, e4m3's rounding by arithmetic); `use_triton` None picks Triton
for CUDA tensors. (The MXFP8 GEMM on Blackwell's MX tensor cores is not written: the layers
multiply the values by their weights' codes through the e4m3 table.)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from batonlm.kernels._checks import fail

GROUP = 32
E4M3_MAX = 448.0


def mx_groups(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x as float32 [..., G, 32] (the last group zero-padded) and K (MXFP8's and MXFP4's groups)."""
    if not x.is_floating_point():
        raise fail("x", "a floating-point tensor", x.dtype)
    k = x.shape[-1]
    pad = -k % GROUP
    xf = torch.nn.functional.pad(x.float(), (0, pad))
    return xf.view(*x.shape[:-1], -1, GROUP), k


def _apply(xg: torch.Tensor, e: torch.Tensor, k: int, like: torch.Tensor) -> torch.Tensor:
    """Values divided by 2^e (exact), rounded to e4m3 (clamped), times 2^e."""
    q = torch.ldexp(xg, -e[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    y = torch.ldexp(q.float(), e[..., None])
    return y.reshape(*like.shape[:-1], -1)[..., :k].to(like.dtype)


def _triton(x: torch.Tensor, rule: int) -> torch.Tensor:
    from batonlm.kernels import _triton_mxfp8

    if not x.is_floating_point():
        raise fail("x", "a floating-point tensor", x.dtype)
    return _triton_mxfp8.mx_quant(x.reshape(-1, x.shape[-1]), rule).view(x.shape)


def _on_triton(x: torch.Tensor, use_triton: bool | None) -> bool:
    return x.is_cuda if use_triton is None else use_triton


def modelopt_mxfp8_fake_quant(x: torch.Tensor, *, use_triton: bool | None = None) -> torch.Tensor:
    """ModelOpt's MXFP8: e = ceil(log2(amax / 448)) in [-127, 127] (amax 0: -127)."""
    if _on_triton(x, use_triton):
        return _triton(x, 0)
    xg, k = mx_groups(x)
    descale = xg.abs().amax(dim=-1) / torch.tensor(E4M3_MAX)
    mantissa, exponent = torch.frexp(descale)  # descale = m 2^x, m in [0.5, 1): ceil(log2) = x, or x - 1 at m = 0.5
    e = torch.where(mantissa == 0.5, exponent - 1, exponent)
    e = torch.where(descale > 0, e, torch.full_like(e, -127)).clamp(-127, 127)
    return _apply(xg, e, k, x)


def ct_mxfp8_fake_quant(x: torch.Tensor, *, use_triton: bool | None = None) -> torch.Tensor:
    """compressed-tensors' MXFP8: amax to a power of two 2^p (up from a mantissa of 1.75), e =
    p - 8, 127 + e clamped to [0, 255] (amax 0: e = -127)."""
    if _on_triton(x, use_triton):
        return _triton(x, 1)
    xg, k = mx_groups(x)
    return _apply(xg, ct_mx_exponents(xg, 8), k, x)


def ct_mx_exponents(xg: torch.Tensor, largest: int) -> torch.Tensor:
    """compressed-tensors' MX scale exponent of each group of `xg` [..., G, 32] ([..., G]): the
    amax rounded to a power of two 2^p (up from a mantissa of 1.75), e = p - `largest` (the
    element format's largest power of two: e4m3's 8, E2M1's 2), 127 + e clamped to [0, 255]
    (amax 0: e = -127)."""
    amax = xg.abs().amax(dim=-1)
    mantissa, exponent = torch.frexp(amax)  # amax = m 2^x, m in [0.5, 1): p = x - 1, + 1 where 2m >= 1.75
    p = exponent - 1 + (mantissa >= 0.875).to(exponent.dtype)
    return torch.where(amax > 0, p - largest, torch.full_like(p, -127)).clamp(-127, 128)


# A layer's MXFP8 activation quantization by the tool whose arithmetic it follows.
MX_INPUTS: dict[str, Callable[..., torch.Tensor]] = {
    "compressed-tensors": ct_mxfp8_fake_quant, "modelopt": modelopt_mxfp8_fake_quant}
