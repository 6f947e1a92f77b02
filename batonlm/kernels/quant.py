"""Quantized linear layers' kernels: FP8 (activations quantized at run time, weights per block,
per channel or per tensor; int4 / int8 weight-only: `int4.py`), each a plain-torch reference
beside a Triton twin (`_triton_quant.py`). The entry points take `use_triton`: None picks Triton for CUDA tensors
(FP8: on a GPU with FP8 support, compute capability 8.9 or more) and torch otherwise.

FP8 scales are float32 and mean "dequantized = stored value * scale" (a checkpoint's
`weight_scale_inv`). Activations are 2-D [M, K]; weights are nn.Linear's [N, K]; y = x @ W^T.

- Activations, dynamically: `per_token_group_quant_fp8` gives x_q [M, K] and a scale
  [M, ceil(K / group)] per row and group of `group` columns (the last may be partial): the
  group's amax / the format's max, so its largest value becomes +-max; values are divided by it
  and rounded to nearest even. A scale is at least float32's smallest normal (or a given
  `min_scale`), so an all-zero group quantizes to zeros (no 0 / 0); with `amax_ub` the amax is
  capped first (FBGEMM FP8's activation bound: a larger value saturates to +-max).
  `per_token_quant_fp8`: one group per row.
  Statically: `static_quant_fp8` divides by a given per-tensor scale (or one per row) and clamps
  to +-max.
- Weights per block (DeepSeek-V3, Qwen3 FP8): w_q [N, K], w_scale [ceil(N / bn), ceil(K / bk)]
  for block (bn, bk); W[n, k] = w_q[n, k] * w_scale[n // bn, k // bk]. `fp8_block_matmul`
  takes x quantized with group = bk and applies both scales per K block.
- Weights per channel ([N] or [N, 1]) or per tensor ([] or [1]), activations per token
  ([M, 1]) or per tensor ([] or [1]): `fp8_scaled_matmul` applies both once, then a bias.
"""

from __future__ import annotations

import torch

from batonlm.kernels._checks import cdiv, check_2d, check_scale, compute_dtype, fail, shape_of

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# The least scale: float32's smallest normal (a zero group divides by it, not by 0).
MIN_SCALE = torch.finfo(torch.float32).tiny
# FBGEMM's per-row FP8 quantization floors a row's scale here (and vLLM's per-token one).
FBGEMM_MIN_SCALE = 1.0 / (448.0 * 512.0)


def _check_fp8(t: torch.Tensor, name: str) -> None:
    check_2d(t, name)
    if t.dtype not in FP8_DTYPES:
        raise fail(name, "float8_e4m3fn or float8_e5m2", t.dtype)


def _fp8_on_triton(t: torch.Tensor, use_triton: bool | None) -> bool:
    if use_triton is not None:
        return use_triton
    return t.is_cuda and torch.cuda.get_device_capability(t.device) >= (8, 9)


def _expand(scale: torch.Tensor, rows_per: int, cols_per: int, rows: int, cols: int) -> torch.Tensor:
    """A per-block scale [ceil(rows / rows_per), ceil(cols / cols_per)] -> one per element."""
    return scale.repeat_interleave(rows_per, 0)[:rows].repeat_interleave(cols_per, 1)[:, :cols]


# --- FP8 activations -------------------------------------------------------------------------


def _check_quant_args(x: torch.Tensor, group: int, dtype: torch.dtype) -> None:
    check_2d(x, "x")
    if not x.is_floating_point():
        raise fail("x", "a floating-point tensor", x.dtype)
    if dtype not in FP8_DTYPES:
        raise fail("dtype", "float8_e4m3fn or float8_e5m2", dtype)
    if group < 1:
        raise fail("group", "a positive number of columns", group)


def _check_bounds(amax_ub: float | None, min_scale: float) -> None:
    if amax_ub is not None and not amax_ub > 0:
        raise fail("amax_ub", "a positive number or None", amax_ub)
    if not min_scale > 0:
        raise fail("min_scale", "a positive number", min_scale)


def per_token_group_quant_fp8_reference(
    x: torch.Tensor, group: int = 128, dtype: torch.dtype = torch.float8_e4m3fn, *,
    amax_ub: float | None = None, min_scale: float = MIN_SCALE,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_quant_args(x, group, dtype)
    _check_bounds(amax_ub, min_scale)
    m, k = x.shape
    fp8_max = torch.finfo(dtype).max
    groups = cdiv(k, group)
    xf = torch.nn.functional.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    amax = xf.abs().amax(dim=2)
    if amax_ub is not None:
        amax = amax.clamp(max=amax_ub)
    # A tensor divisor: CUDA divides by a Python scalar as a multiply by its reciprocal.
    scale = (amax / torch.full_like(amax, fp8_max)).clamp(min=min_scale)
    q = (xf / scale[:, :, None]).clamp(-fp8_max, fp8_max).to(dtype)
    return q.view(m, groups * group)[:, :k].contiguous(), scale


def per_token_group_quant_fp8(
    x: torch.Tensor, group: int = 128, dtype: torch.dtype = torch.float8_e4m3fn, *, use_triton: bool | None = None,
    amax_ub: float | None = None, min_scale: float = MIN_SCALE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_q [M, K] in `dtype`, scale float32 [M, ceil(K / group)]). `amax_ub`: a
    group's amax is capped at it first (FBGEMM's `scale_ub`: larger values saturate to +-max);
    `min_scale`: the least scale."""
    if not _fp8_on_triton(x, use_triton):
        return per_token_group_quant_fp8_reference(x, group, dtype, amax_ub=amax_ub, min_scale=min_scale)
    _check_quant_args(x, group, dtype)
    _check_bounds(amax_ub, min_scale)
    from batonlm.kernels import _triton_quant

    return _triton_quant.quant_fp8(x, group, dtype, min_scale, amax_ub=amax_ub)


def per_token_quant_fp8(
    x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, *, use_triton: bool | None = None,
    amax_ub: float | None = None, min_scale: float = MIN_SCALE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_q [M, K], scale float32 [M, 1]): one group per row."""
    check_2d(x, "x")
    return per_token_group_quant_fp8(x, max(1, x.shape[1]), dtype, use_triton=use_triton, amax_ub=amax_ub,
                                     min_scale=min_scale)


def _static_shapes(x: torch.Tensor) -> list[tuple[int, ...]]:
    """A static activation scale: per tensor, or one per row (MoE pairs, each its expert's)."""
    return [(), (1,), (x.shape[0], 1)]


def static_quant_fp8_reference(x: torch.Tensor, scale: torch.Tensor,
                               dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    _check_quant_args(x, 1, dtype)
    check_scale(scale, "scale", _static_shapes(x))
    fp8_max = torch.finfo(dtype).max
    return (x.float() / scale.reshape(-1, 1)).clamp(-fp8_max, fp8_max).to(dtype)


def static_quant_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, *,
                     use_triton: bool | None = None) -> torch.Tensor:
    """x [M, K] / a float32 `scale`, per tensor ([] or [1], e.g. a checkpoint's input_scale) or
    per row ([M, 1]), clamped to the format's range -> x_q [M, K]."""
    if not _fp8_on_triton(x, use_triton):
        return static_quant_fp8_reference(x, scale, dtype)
    _check_quant_args(x, 1, dtype)
    check_scale(scale, "scale", _static_shapes(x))
    from batonlm.kernels import _triton_quant

    return _triton_quant.quant_fp8(x, 4096, dtype, MIN_SCALE, static_scale=scale)[0]


# --- FP8 weights -----------------------------------------------------------------------------


def _check_block(block: tuple[int, int]) -> tuple[int, int]:
    if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise fail("block", "(block_n, block_k), two positive ints", block)
    return block[0], block[1]


def dequantize_fp8_block(w_q: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int],
                         dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """W [N, K] in `dtype` = w_q * the scale of its block (computed in float32, or float64)."""
    _check_fp8(w_q, "w_q")
    bn, bk = _check_block(block)
    n, k = w_q.shape
    check_scale(w_scale, "w_scale", [(cdiv(n, bn), cdiv(k, bk))])
    c = compute_dtype(dtype)
    return (w_q.to(c) * _expand(w_scale.to(c), bn, bk, n, k)).to(dtype)


def _channel_scale(w_scale: torch.Tensor, n: int) -> torch.Tensor:
    check_scale(w_scale, "w_scale", [(), (1,), (n,), (n, 1)])
    return w_scale.reshape(-1, 1)  # [1, 1] or [N, 1]


def dequantize_fp8(w_q: torch.Tensor, w_scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """W [N, K] in `dtype` = w_q * its per-tensor ([] / [1]) or per-channel ([N] / [N, 1]) scale."""
    _check_fp8(w_q, "w_q")
    c = compute_dtype(dtype)
    return (w_q.to(c) * _channel_scale(w_scale, w_q.shape[0]).to(c)).to(dtype)


def _check_block_matmul(x_q, x_scale, w_q, w_scale, block) -> tuple[int, int]:
    _check_fp8(x_q, "x_q")
    _check_fp8(w_q, "w_q")
    if x_q.dtype != w_q.dtype:
        raise fail("w_q", f"x_q's dtype {x_q.dtype}", w_q.dtype)
    if x_q.shape[1] != w_q.shape[1]:
        raise fail("w_q", f"[N, {x_q.shape[1]}] (x_q's K)", f"shape {shape_of(w_q)}")
    bn, bk = _check_block(block)
    (m, k), n = x_q.shape, w_q.shape[0]
    check_scale(x_scale, "x_scale", [(m, cdiv(k, bk))])
    check_scale(w_scale, "w_scale", [(cdiv(n, bn), cdiv(k, bk))])
    return bn, bk


def fp8_block_matmul_reference(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                               block: tuple[int, int], out_dtype: torch.dtype) -> torch.Tensor:
    """Both operands dequantized in float32, one matmul."""
    bn, bk = _check_block_matmul(x_q, x_scale, w_q, w_scale, block)
    return fp8_block_product(x_q, x_scale, dequantize_fp8_block(w_q, w_scale, (bn, bk), torch.float32), bk, out_dtype)


def fp8_block_product(x_q: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, bk: int,
                      out_dtype: torch.dtype) -> torch.Tensor:
    """The reference's product given its float32 weight operand W = `dequantize_fp8_block(w_q,
    w_scale, block, float32)` (which a CPU layer computes once on load, not at every call)."""
    m, k = x_q.shape
    x = x_q.float() * _expand(x_scale, 1, bk, m, k)
    return (x @ w.T).to(out_dtype)


def fp8_block_matmul(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                     block: tuple[int, int], out_dtype: torch.dtype, *, use_triton: bool | None = None) -> torch.Tensor:
    """y [M, N] in `out_dtype` = x @ W^T: x_q [M, K] with x_scale [M, ceil(K / bk)]
    (`per_token_group_quant_fp8` with group = bk), w_q [N, K] with w_scale
    [ceil(N / bn), ceil(K / bk)], block = (bn, bk). The Triton kernel needs bk a multiple of 16."""
    if not _fp8_on_triton(x_q, use_triton):
        return fp8_block_matmul_reference(x_q, x_scale, w_q, w_scale, block, out_dtype)
    bn, bk = _check_block_matmul(x_q, x_scale, w_q, w_scale, block)
    from batonlm.kernels import _triton_quant

    return _triton_quant.fp8_matmul(x_q, w_q, x_scale, (x_scale.stride(0), x_scale.stride(1)), w_scale,
                                    (w_scale.stride(0), w_scale.stride(1)), bn, bk, out_dtype, None)


def _check_scaled_matmul(x_q, x_scale, w_q, w_scale, bias) -> tuple[torch.Tensor, torch.Tensor]:
    """The two scales as [M or 1, 1] and [N or 1, 1]."""
    _check_fp8(x_q, "x_q")
    _check_fp8(w_q, "w_q")
    if x_q.dtype != w_q.dtype:
        raise fail("w_q", f"x_q's dtype {x_q.dtype}", w_q.dtype)
    if x_q.shape[1] != w_q.shape[1]:
        raise fail("w_q", f"[N, {x_q.shape[1]}] (x_q's K)", f"shape {shape_of(w_q)}")
    m, n = x_q.shape[0], w_q.shape[0]
    check_scale(x_scale, "x_scale", [(), (1,), (m, 1)])
    if bias is not None and shape_of(bias) != (n,):
        raise fail("bias", f"shape [{n}]", f"shape {shape_of(bias)}")
    return x_scale.reshape(-1, 1), _channel_scale(w_scale, n)


def fp8_scaled_matmul_reference(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                                out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The FP8 product in float32, times both scales, plus the bias."""
    xs, ws = _check_scaled_matmul(x_q, x_scale, w_q, w_scale, bias)
    return fp8_scaled_product(x_q, xs, w_q.float(), ws, out_dtype, bias)


def fp8_scaled_product(x_q: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor,
                       out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference's product given its float32 weight operand W = w_q.float() (the codes, which
    a CPU layer converts once on load) and the scales as [M or 1, 1] and [N or 1, 1]."""
    y = (x_q.float() @ w.T) * (xs * ws.T)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def fp8_scaled_matmul(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                      out_dtype: torch.dtype, bias: torch.Tensor | None = None, *,
                      use_triton: bool | None = None) -> torch.Tensor:
    """y [M, N] in `out_dtype` = (x_q @ w_q^T) * x_scale * w_scale + bias: x_scale [] / [1] (per
    tensor) or [M, 1] (per token), w_scale [] / [1] (per tensor) or [N] / [N, 1] (per channel)."""
    if not _fp8_on_triton(x_q, use_triton):
        return fp8_scaled_matmul_reference(x_q, x_scale, w_q, w_scale, out_dtype, bias)
    xs, ws = _check_scaled_matmul(x_q, x_scale, w_q, w_scale, bias)
    from batonlm.kernels import _triton_quant

    xs, ws = xs.contiguous(), ws.contiguous()
    x_strides = (int(xs.shape[0] > 1), 0)  # a stride of 0 broadcasts a per-tensor scale
    w_strides = (int(ws.shape[0] > 1), 0)
    return _triton_quant.fp8_matmul(x_q, w_q, xs, x_strides, ws, w_strides, 1, None, out_dtype, bias)
