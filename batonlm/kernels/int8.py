"""W8A8-int8 linear layers' kernels: activations quantized to int8 at run time, weights int8 with
one scale per output channel (or per tensor), their product summed exactly in int32. Each a
plain-torch reference beside a Triton twin (`_triton_int8.py`); `use_triton`: None picks Triton
for CUDA tensors, torch elsewhere.

Scales are float32 and mean "dequantized = code * scale". Symmetric quantization as
compressed-tensors defines it (llm-compressor's `W8A8` / `INT8` scheme, and transformers'
reference for those checkpoints):
- per token, dynamically (`per_token_quant_int8`): scale = amax / 127.5, the token's largest
  |x| over the half range (127 - (-128)) / 2 (at least float32's smallest normal, so an all-zero
  token quantizes to zeros); code = x / scale rounded half to even and clamped to [-128, 127], so
  +amax lands on 127 and -amax on -128. (vLLM divides by 127; the two differ by at most one code.)
- per tensor, statically (`static_quant_int8`): the same with a given scale (a checkpoint's
  `input_scale`; or one per row, MoE pairs each by its expert's), saturating at -128 and 127.
Asymmetric, with a zero point (compressed-tensors' `symmetric: false` activations):
- per token (`per_token_quant_int8_asym`): the token's range widened to include 0, lo = min(min
  x, 0), hi = max(max x, 0); scale = (hi - lo) / 255 (float32's eps where that is 0); zero =
  -128 - lo / scale clamped to [-128, 127] and rounded half to even; code = x / scale + zero
  (each operation rounded to float32 in turn) rounded half to even, clamped. So lo lands on
  -128 and hi on 127, and the code for 0 is the zero point.
- per tensor (`static_quant_int8` with `zero`): a checkpoint's `input_scale` and
  `input_zero_point`, the same code.
- `int8_scaled_matmul`: y = (x_q @ w_q^T) * x_scale * w_scale (+ bias). The integer product is
  exact in int32 (|sum| <= 128^2 K < 2^31 for K < 131072); it is converted to float32 once and
  multiplied by the two scales in that order (then the bias is added, then the result is
  converted to `out_dtype`), which the Triton kernel does too, so the two agree bit for bit.
  With zero points (`x_zero` per token or tensor, and the weight's row sums `w_sum` =
  `weight_sums(w_q)`) the integer part is sum_k (x_q - zero) w_q = x_q @ w_q^T - zero * w_sum,
  exact in int32 too (|sum| <= 255 * 128 K < 2^31 for K <= 65793).
Activations are 2-D [M, K]; weights are nn.Linear's [N, K]; y = x @ W^T.
"""

from __future__ import annotations

import torch

from batonlm.kernels._checks import check_2d, check_scale, fail
from batonlm.kernels.quant import MIN_SCALE  # the least scale: an all-zero token divides by it, not by 0

INT8_HALF_RANGE = 127.5  # (127 - (-128)) / 2: compressed-tensors' symmetric scale divisor
INT8_RANGE = 255.0  # 127 - (-128): its asymmetric scale divisor
ASYM_ZERO_SCALE = torch.finfo(torch.float32).eps  # its scale for a token whose range is 0
QMIN, QMAX = -128, 127
MAX_K = 131071  # past it the int32 sum of 128 * 128 products could overflow
MAX_K_ASYM = 65793  # with zero points: 255 * 128 per product


def _check_x(x: torch.Tensor) -> None:
    check_2d(x, "x")
    if not x.is_floating_point():
        raise fail("x", "a floating-point tensor", x.dtype)


def _on_triton(t: torch.Tensor, use_triton: bool | None) -> bool:
    return t.is_cuda if use_triton is None else use_triton


def _static_shapes(x: torch.Tensor) -> list[tuple[int, ...]]:
    return [(), (1,), (x.shape[0], 1)]


def _codes(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None) -> torch.Tensor:
    v = x.float() / scale
    if zero is not None:
        v = v + zero.to(torch.float32)
    return torch.round(v).clamp(QMIN, QMAX).to(torch.int8)



def per_token_quant_int8_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _check_x(x)
    amax = x.float().abs().amax(dim=1, keepdim=True) if x.shape[1] else x.new_zeros((x.shape[0], 1), dtype=torch.float32)
    # A tensor divisor: CUDA divides by a Python scalar as a multiply by its reciprocal.
    scale = (amax / torch.full_like(amax, INT8_HALF_RANGE)).clamp(min=MIN_SCALE)
    return _codes(x, scale), scale


def per_token_quant_int8(x: torch.Tensor, *, use_triton: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_q int8 [M, K], scale float32 [M, 1])."""
    if not _on_triton(x, use_triton):
        return per_token_quant_int8_reference(x)
    _check_x(x)
    from batonlm.kernels import _triton_int8

    return _triton_int8.quant_int8(x, MIN_SCALE, INT8_HALF_RANGE)


def per_token_quant_int8_asym_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_x(x)
    xf = x.float()
    if x.shape[1]:
        lo, hi = xf.amin(dim=1, keepdim=True).clamp(max=0.0), xf.amax(dim=1, keepdim=True).clamp(min=0.0)
    else:
        lo = hi = xf.new_zeros((x.shape[0], 1))
    scale = (hi - lo) / torch.full_like(hi, INT8_RANGE)
    scale = torch.where(scale == 0, torch.full_like(scale, ASYM_ZERO_SCALE), scale)
    zero = torch.round((-128.0 - lo / scale).clamp(QMIN, QMAX))
    return _codes(x, scale, zero), scale, zero.to(torch.int32)


def per_token_quant_int8_asym(x: torch.Tensor, *, use_triton: bool | None = None,
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_q int8 [M, K], scale float32 [M, 1], zero int32 [M, 1]): asymmetric."""
    if not _on_triton(x, use_triton):
        return per_token_quant_int8_asym_reference(x)
    _check_x(x)
    from batonlm.kernels import _triton_int8

    return _triton_int8.quant_int8_asym(x, INT8_RANGE, ASYM_ZERO_SCALE)


def _check_static(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> None:
    _check_x(x)
    check_scale(scale, "scale", _static_shapes(x))
    if zero is not None:
        check_scale(zero, "zero", [tuple(scale.shape)], torch.int32)


def static_quant_int8_reference(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None) -> torch.Tensor:
    _check_static(x, scale, zero)
    return _codes(x, scale.reshape(-1, 1), None if zero is None else zero.reshape(-1, 1))


def static_quant_int8(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None, *,
                      use_triton: bool | None = None) -> torch.Tensor:
    """x [M, K] / a float32 `scale`, per tensor ([] or [1]) or per row ([M, 1]), plus an int32
    `zero` point of the scale's shape (asymmetric), rounded and saturated -> x_q int8."""
    if not _on_triton(x, use_triton):
        return static_quant_int8_reference(x, scale, zero)
    _check_static(x, scale, zero)
    from batonlm.kernels import _triton_int8

    return _triton_int8.quant_int8(x, MIN_SCALE, INT8_HALF_RANGE, static_scale=scale, static_zero=zero)[0]


def weight_sums(w_q: torch.Tensor) -> torch.Tensor:
    """Each output row's sum of its int8 weights, int32 [N]: what a zero point's product takes off."""
    return w_q.sum(dim=1, dtype=torch.int32)


def _check_matmul(x_q, x_scale, w_q, w_scale, bias, x_zero=None, w_sum=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The two scales as [M or 1, 1] and [N or 1, 1]."""
    for t, name in ((x_q, "x_q"), (w_q, "w_q")):
        if t.dim() != 2 or t.dtype != torch.int8:
            raise fail(name, "a 2-D int8 tensor", f"{t.dtype} {tuple(t.shape)}")
    if x_q.shape[1] != w_q.shape[1]:
        raise fail("w_q", f"[N, {x_q.shape[1]}] (x_q's K)", f"shape {tuple(w_q.shape)}")
    if x_q.shape[1] > MAX_K:
        raise fail("x_q", f"at most {MAX_K} columns (the int32 sum's range)", x_q.shape[1])
    m, n = x_q.shape[0], w_q.shape[0]
    check_scale(x_scale, "x_scale", [(), (1,), (m, 1)])
    check_scale(w_scale, "w_scale", [(), (1,), (n,), (n, 1)])
    if bias is not None and tuple(bias.shape) != (n,):
        raise fail("bias", f"shape [{n}]", f"shape {tuple(bias.shape)}")
    if (x_zero is None) != (w_sum is None):
        raise fail("w_sum", "given with x_zero (and only then)", "missing" if w_sum is None else "given alone")
    if x_zero is not None:
        check_scale(x_zero, "x_zero", [tuple(x_scale.shape)], torch.int32)
        check_scale(w_sum, "w_sum", [(n,)], torch.int32)
        if x_q.shape[1] > MAX_K_ASYM:
            raise fail("x_q", f"at most {MAX_K_ASYM} columns with zero points (the int32 sum's range)", x_q.shape[1])
    return x_scale.reshape(-1, 1), w_scale.reshape(-1, 1)


def int_product(x_q: torch.Tensor, w_q: torch.Tensor) -> torch.Tensor:
    """x_q [M, K] @ w_q [N, K]^T, int32, exact: the CPU's int8 GEMM (oneDNN, through
    `torch._int_mm`), elsewhere float64 (every partial sum is an integer below 2^53). K = 1 goes
    through float64 too: the CPU kernel misreads a one-column weight's transpose (torch 2.13).
    One row goes in twice: a compiled graph may hand the kernel a row of a larger buffer with a
    zero row stride (legal for a size-1 dimension), which it misreads too (torch 2.13)."""
    if x_q.device.type == "cpu" and x_q.shape[0] and x_q.shape[1] > 1:
        if x_q.shape[0] == 1:
            return torch._int_mm(x_q.expand(2, -1).contiguous(), w_q.contiguous().t())[:1]
        return torch._int_mm(x_q.contiguous(), w_q.contiguous().t())
    return (x_q.double() @ w_q.double().t()).to(torch.int32)


def int8_scaled_matmul_reference(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                                 out_dtype: torch.dtype, bias: torch.Tensor | None = None,
                                 x_zero: torch.Tensor | None = None, w_sum: torch.Tensor | None = None) -> torch.Tensor:
    xs, ws = _check_matmul(x_q, x_scale, w_q, w_scale, bias, x_zero, w_sum)
    acc = int_product(x_q, w_q)
    if x_zero is not None and w_sum is not None:
        acc = acc - x_zero.reshape(-1, 1) * w_sum.reshape(1, -1)
    y = acc.float() * xs * ws.T
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def int8_scaled_matmul(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                       out_dtype: torch.dtype, bias: torch.Tensor | None = None, *,
                       x_zero: torch.Tensor | None = None, w_sum: torch.Tensor | None = None,
                       use_triton: bool | None = None) -> torch.Tensor:
    """y [M, N] in `out_dtype` = ((x_q - x_zero) @ w_q^T) * x_scale * w_scale + bias: x_scale [] /
    [1] (per tensor) or [M, 1] (per token), w_scale [] / [1] (per tensor) or [N] / [N, 1] (per
    channel); x_zero (int32, x_scale's shape) with w_sum = weight_sums(w_q), or neither."""
    if not _on_triton(x_q, use_triton):
        return int8_scaled_matmul_reference(x_q, x_scale, w_q, w_scale, out_dtype, bias, x_zero, w_sum)
    xs, ws = _check_matmul(x_q, x_scale, w_q, w_scale, bias, x_zero, w_sum)
    from batonlm.kernels import _triton_int8

    zero = None if x_zero is None or w_sum is None else (x_zero.reshape(-1, 1).contiguous(), w_sum.contiguous())
    return _triton_int8.int8_matmul(x_q, w_q, xs.contiguous(), ws.contiguous(), out_dtype, bias, zero)
