"""LLM.int8 (bitsandbytes' 8-bit layers, `BitsAndBytesConfig(load_in_8bit=True)`; Dettmers et al.
2022): int8 weights with one scale per output row, int8 activations per row, and the activations'
outlier columns multiplied in float. The plain-torch reference beside a fused Triton GEMM
(`_triton_llm_int8.py`); `use_triton`: None picks Triton for CUDA tensors, torch elsewhere.

Weights: codes w_q int8 [N, K] and `scb` float32 [N], each row's absmax: W = w_q * scb / 127.
Activations x [M, K] (any float dtype), as bitsandbytes' `MatMul8bitLt` computes them:
- `llm_int8_quant`: x is taken in float16 (x16); an element is an outlier where |x16| >=
  `threshold` (none when the threshold is 0), a column holding one an outlier column. A row's
  statistic rs is its largest |x16| over the other elements (float32); its codes are
  x16 * (127 * (1 / rs)) (the reciprocal and the products each rounded to float32, as torch's
  scalar-by-tensor division computes bitsandbytes' `127.0 / rs`) rounded half to even, an
  outlier column's codes 0. A row whose statistic is 0 has codes 0 (bitsandbytes' would be 0 / 0).
- `llm_int8_matmul`: y = (x_q @ w_q^T) * (rs * scb) * C1 (+ bias) + ((x * m) @ w_q^T) * scb * C2
  with m the outlier columns (1) and the others (0), C1 = 6.200124e-05 (bitsandbytes' constant
  for 1 / 127^2, 1.8e-5 above it: kept, so outputs are bitsandbytes') and C2 = 1 / 127 in float32: the integer product exact in int32, converted to float32
  once and multiplied in that order (bitsandbytes' `int8_mm_dequant`); the outlier columns'
  product in float32 from x itself (not its float16 copy) and the codes. bitsandbytes multiplies
  those columns by W = fl(fl(w_q * scb) * C2) instead of scaling their sum: the two differ by
  float32 rounding (a few units of 2^-24 of sum |x| |W|). In a half-precision model
  bitsandbytes rounds the integer part to that precision before adding the outliers' product
  (computed there too); here both are float32 until the one rounding of y. The reference gathers
  the outlier columns (their indices on the host); the Triton kernel multiplies the masked
  activations (no host synchronisation).
"""

from __future__ import annotations

import torch

from batonlm.kernels._checks import check_2d, fail
from batonlm.kernels.int8 import MAX_K, int_product

INT_SCALE = 6.200124e-05  # C1: bitsandbytes' constant for 1 / 127^2 (1.8e-5 above it)
OUTLIER_SCALE = 7.874015718698502e-3  # C2: 1 / 127 in float32, as bitsandbytes dequantizes a row
DEFAULT_THRESHOLD = 6.0  # transformers' BitsAndBytesConfig.llm_int8_threshold


def _check_x(x: torch.Tensor) -> None:
    check_2d(x, "x")
    if not x.is_floating_point():
        raise fail("x", "a floating-point tensor", x.dtype)


@torch.library.custom_op("batonlm::float16_values", mutates_args=())
def float16_values(x: torch.Tensor) -> torch.Tensor:
    """x rounded to float16, as float32: one opaque op, since a compiled graph (inductor keeps
    half-precision intermediates in float32) would drop the round trip."""
    return x.to(torch.float16).float()


@float16_values.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape, dtype=torch.float32)


def llm_int8_quant(x: torch.Tensor, threshold: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_q int8 [M, K], rs float32 [M], outlier columns float32 [K]: 1 or 0). Torch
    operations on every device (no host synchronisation: a mask, not the columns' indices)."""
    _check_x(x)
    if threshold < 0:
        raise fail("threshold", "a non-negative number (0: no outliers)", threshold)
    x16 = float16_values(x)
    if threshold > 0:
        outlier = x16.abs() >= threshold
        x16 = x16.masked_fill(outlier, 0.0)
        cols = outlier.any(dim=0)
    else:
        cols = torch.zeros(x.shape[1], dtype=torch.bool, device=x.device)
    rs = x16.abs().amax(dim=1) if x.shape[1] else x16.new_zeros(x.shape[0])
    codes = torch.round(x16 * (rs.reciprocal() * 127.0)[:, None])
    codes = codes.masked_fill(cols[None, :] | (rs == 0)[:, None], 0.0)
    return codes.to(torch.int8), rs, cols.to(torch.float32)


def _check_matmul(x, x_q, rs, cols, w_q, scb, bias) -> None:
    _check_x(x)
    m, k = x.shape
    for t, name in ((x_q, "x_q"), (w_q, "w_q")):
        if t.dim() != 2 or t.dtype != torch.int8 or t.shape[1] != k:
            raise fail(name, f"a 2-D int8 tensor of {k} columns (x's)", f"{t.dtype} {tuple(t.shape)}")
    if x_q.shape[0] != m:
        raise fail("x_q", f"{m} rows (x's)", f"shape {tuple(x_q.shape)}")
    if k > MAX_K:
        raise fail("x", f"at most {MAX_K} columns (the int32 sum's range)", k)
    n = w_q.shape[0]
    for t, name, size in ((rs, "rs", m), (cols, "cols", k), (scb, "scb", n)):
        if t.dtype != torch.float32 or tuple(t.shape) != (size,):
            raise fail(name, f"float32 [{size}]", f"{t.dtype} {tuple(t.shape)}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise fail("bias", f"shape [{n}]", f"shape {tuple(bias.shape)}")


def llm_int8_matmul_reference(x: torch.Tensor, x_q: torch.Tensor, rs: torch.Tensor, cols: torch.Tensor,
                              w_q: torch.Tensor, scb: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    _check_matmul(x, x_q, rs, cols, w_q, scb, bias)
    y = int_product(x_q, w_q).float() * (rs[:, None] * scb[None, :]) * INT_SCALE
    if bias is not None:
        y = y + bias.float()
    return (y + _outlier_product(x, cols, w_q, scb)).to(x.dtype)


@torch.library.custom_op("batonlm::llm_int8_outliers", mutates_args=())
def _outlier_product(x: torch.Tensor, cols: torch.Tensor, w_q: torch.Tensor, scb: torch.Tensor) -> torch.Tensor:
    """float32 [M, N]: the outlier columns of x times those of W, only those columns gathered
    (their indices read on the host) and their codes converted to float32. One opaque op, so a compiled graph calls it as it is rather
    than multiplying every column of masked activations (its shapes fixed by the batch alone)."""
    idx = cols.nonzero().flatten()
    if not idx.numel():
        return x.new_zeros((x.shape[0], w_q.shape[0]), dtype=torch.float32)
    return (x[:, idx].float() @ w_q[:, idx].float().T) * scb * OUTLIER_SCALE


@_outlier_product.register_fake
def _(x: torch.Tensor, cols: torch.Tensor, w_q: torch.Tensor, scb: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], w_q.shape[0]), dtype=torch.float32)


def llm_int8_matmul(x: torch.Tensor, x_q: torch.Tensor, rs: torch.Tensor, cols: torch.Tensor, w_q: torch.Tensor,
                    scb: torch.Tensor, bias: torch.Tensor | None = None, *,
                    use_triton: bool | None = None) -> torch.Tensor:
    """y [M, N] in x's dtype: x [M, K] through the LLM.int8 layer of codes w_q [N, K] and row
    scales scb [N], given `llm_int8_quant(x, threshold)`'s (x_q, rs, cols)."""
    if not (x.is_cuda if use_triton is None else use_triton):
        return llm_int8_matmul_reference(x, x_q, rs, cols, w_q, scb, bias)
    _check_matmul(x, x_q, rs, cols, w_q, scb, bias)
    from batonlm.kernels import _triton_llm_int8

    return _triton_llm_int8.llm_int8_matmul(x, x_q, rs, cols, w_q, scb, bias)
