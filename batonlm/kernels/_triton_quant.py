"""Triton kernels behind batonlm.kernels.quant (imported on first use; see there for the layouts).

Three kernels:

- `_quant_fp8_kernel`: a program per (row, group): the group's amax (capped at `amax_ub`), its scale, the values
  divided by it (correctly rounded: `div_rn`, as torch divides), clamped to the format's range
  and stored as FP8. The group is read in chunks, so one row-wide group (per-token) fits too.
- `_fp8_matmul_kernel`: y = x_q @ w_q^T with FP8 tiles in `tl.dot` (an H100/H200 runs FP8
  tensor-core MMAs) accumulating in float32. Block-wise scales multiply each K block's partial
  product (the K tile divides the scale block, so a tile never straddles two); per-tensor and
  per-channel scales multiply the whole sum once at the end (a stride of 0 broadcasts one).
  An H100/H200 adds FP8 products in reduced precision (about 14 bits, DeepSeek-V3's report);
  `max_num_imprecise_acc` makes it add each tile's partial product into the float32
  accumulator, so the imprecision spans at most one K tile (<= 128), as DeepSeek-V3 does.
- `_int4_matmul_kernel`: each K tile of `qweight` unpacked (8 nibbles, or 4 bytes, per int32), dequantized
  (q - zero) * scale in float32, rounded to the activation dtype and multiplied in `tl.dot`; the
  scale and zero of a row's group (row // group, or its `g_idx` entry in activation order).

Under the interpreter (CPU tests), two things differ, both measured on triton 3.9:
- its float32 -> float8 conversion rounds wrongly (a carry out of the mantissa halves the value:
  127.9 -> 64 in e4m3; ties go away from zero), so `_quant_fp8_kernel` stores the scaled,
  clamped float32 values and the wrapper rounds them with torch (round to nearest even, what a
  GPU's `cvt.rn.satfinite` does);
- tiles are converted to float32 before `tl.dot` (the interpreter multiplies narrow tiles in
  their own precision; FP8 and bfloat16 values are exact in float32, so the products are too).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batonlm.kernels._triton_common import INTERPRET, NO_FMA, device_fn, tile

# GPU launch shape: the matmuls are memory-bound at decode sizes; a few stages hide the loads.
_GPU_OPTS = {} if INTERPRET else {"num_warps": 4, "num_stages": 3}


@triton.jit
def _quant_fp8_kernel(
    x_ptr, q_ptr, s_ptr, K, group, groups_per_row, stride_xm, stride_qm, stride_s, fp8_max, min_scale, amax_ub,
    STATIC: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * group
    end = tl.minimum(start + group, K)
    x_row = x_ptr + row * stride_xm
    if STATIC:  # a stride of 0: one scale for every row
        scale = tl.load(s_ptr + row * stride_s).to(tl.float32)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(start, end, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_row + offs, mask=offs < end, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.math.div_rn(tl.minimum(tl.max(amax, axis=0), amax_ub), fp8_max), min_scale)
        tl.store(s_ptr + row * groups_per_row + tl.program_id(1), scale)
    for k0 in range(start, end, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < end, other=0.0).to(tl.float32)
        y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -fp8_max), fp8_max)
        tl.store(q_ptr + row * stride_qm + offs, y.to(q_ptr.dtype.element_ty), mask=offs < end)


def quant_fp8(x: torch.Tensor, group: int, dtype: torch.dtype, min_scale: float,
              static_scale: torch.Tensor | None = None, amax_ub: float | None = None,
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] in `dtype`, scale float32 [M, ceil(K / group)]; a group's amax
    capped at `amax_ub` first), or with `static_scale` (one float32 element, or one per row
    [M, 1]) q divided by it and that scale."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x.shape
    groups = triton.cdiv(k, group)
    q = torch.empty((m, k), dtype=torch.float32 if INTERPRET else dtype, device=x.device)
    scale = static_scale.contiguous() if static_scale is not None else torch.empty(
        (m, groups), dtype=torch.float32, device=x.device)
    stride_s = 1 if static_scale is not None and static_scale.numel() > 1 else 0
    if m and k:
        cap = 8192 if INTERPRET else 1024
        block = tile(group, cap)
        _quant_fp8_kernel[(m, groups)](
            x, q, scale, k, group, groups, x.stride(0), q.stride(0), stride_s, torch.finfo(dtype).max, min_scale,
            float("inf") if amax_ub is None else amax_ub, STATIC=static_scale is not None, BLOCK=block, **NO_FMA,
        )
    return (q.to(dtype) if INTERPRET else q), scale


@device_fn
def _scales(xs_ptr, ws_ptr, offs_m, offs_n, m_valid, n_valid, kb, block_n, stride_xsm, stride_xsk,
            stride_wsn, stride_wsk):
    """[BLOCK_M, BLOCK_N] float32: x's scale of each row times w's of each column, K block kb."""
    xs = tl.load(xs_ptr + offs_m * stride_xsm + kb * stride_xsk, mask=m_valid, other=0.0)
    ws = tl.load(ws_ptr + (offs_n // block_n) * stride_wsn + kb * stride_wsk, mask=n_valid, other=0.0)
    return xs[:, None] * ws[None, :]


@triton.jit
def _fp8_matmul_kernel(
    x_ptr, w_ptr, y_ptr, xs_ptr, ws_ptr, bias_ptr, M, N, K, block_n, block_k,
    stride_xm, stride_wn, stride_ym, stride_xsm, stride_xsk, stride_wsn, stride_wsk,
    K_BLOCKED: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_valid, n_valid = offs_m < M, offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_valid = offs_k < K
        a = tl.load(x_rows + offs_k[None, :], mask=m_valid[:, None] & k_valid[None, :], other=0.0)
        b = tl.load(w_cols + offs_k[:, None], mask=n_valid[None, :] & k_valid[:, None], other=0.0)
        if UPCAST:
            d = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:  # Hopper's FP8 MMA adds in ~14 bits: promote to float32 at least every tile
            d = tl.dot(a, b, max_num_imprecise_acc=BLOCK_K)
        if K_BLOCKED:
            s = _scales(xs_ptr, ws_ptr, offs_m, offs_n, m_valid, n_valid, k0 // block_k, block_n,
                        stride_xsm, stride_xsk, stride_wsn, stride_wsk)
            acc += d * s
        else:
            acc += d
    if not K_BLOCKED:
        acc = acc * _scales(xs_ptr, ws_ptr, offs_m, offs_n, m_valid, n_valid, 0, block_n,
                            stride_xsm, stride_xsk, stride_wsn, stride_wsk)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc, mask=m_valid[:, None] & n_valid[None, :])  # converted to y's dtype by the store


def _tile_m(m: int) -> int:
    return tile(m, 64)


def fp8_matmul(x_q: torch.Tensor, w_q: torch.Tensor, x_scale: torch.Tensor, x_scale_strides: tuple[int, int],
               w_scale: torch.Tensor, w_scale_strides: tuple[int, int], block_n: int, block_k: int | None,
               out_dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    """y [M, N] = x_q [M, K] @ w_q [N, K]^T with scales. `block_k` None: one scale per row of x
    and per column of w (strides of 0 broadcast a per-tensor one), applied once; else scale
    x_scale[m, k // block_k] * w_scale[n // block_n, k // block_k] per K block."""
    x_q = x_q if x_q.stride(-1) == 1 else x_q.contiguous()
    w_q = w_q if w_q.stride(-1) == 1 else w_q.contiguous()
    (m, k), n = x_q.shape, w_q.shape[0]
    y = torch.empty((m, n), dtype=out_dtype, device=x_q.device)
    if m == 0 or n == 0:
        return y
    if block_k is None:
        tile_k = tile(k, 128)
    else:  # the largest power of two dividing the scale block, so a tile never straddles two
        tile_k = min(128, block_k & -block_k)
        if tile_k < 16:
            raise ValueError(f"block: the Triton kernel needs a K block that is a multiple of 16, got {block_k}")
    block_m, tile_n = _tile_m(m), tile(n, 128)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, tile_n))
    _fp8_matmul_kernel[grid](
        x_q, w_q, y, x_scale, w_scale, bias.contiguous() if bias is not None else y, m, n, k, block_n, block_k or k,
        x_q.stride(0), w_q.stride(0), y.stride(0), *x_scale_strides, *w_scale_strides,
        K_BLOCKED=block_k is not None, HAS_BIAS=bias is not None, UPCAST=INTERPRET,
        BLOCK_M=block_m, BLOCK_N=tile_n, BLOCK_K=tile_k, **NO_FMA, **_GPU_OPTS,
    )
    return y


@device_fn
def int4_tile(qw_ptr, s_ptr, z_ptr, gidx_ptr, cb_ptr, s2_ptr, offs_k, offs_n, k_valid, n_valid, k0, group, stride_qk,
              stride_sg, stride_zg, ROW_SCALES: tl.constexpr, G_IDX: tl.constexpr, BITS: tl.constexpr,
              CODEBOOK: tl.constexpr, SCALE_2: tl.constexpr, E8M0: tl.constexpr = False):
    """[BLOCK_K, BLOCK_N] float32: rows `offs_k` and columns `offs_n` of W^T from `BITS`-bit
    codes (32 / BITS per int32 along K), (q - zero) * scale of each row's group (exact), or with
    `CODEBOOK` codebook[q] * scale (one float32 rounding; no zeros): the tile's one group
    (`ROW_SCALES`), row // group, or in activation order the row's `g_idx` entry (`G_IDX`); with
    `SCALE_2` 1 each scale (float8) times its column's float32 factor first, with 2 divided by it
    (correctly rounded, as torch divides), rounded once; with `E8M0` the scales are uint8
    exponents, 2^(e - 127) built from their bits (exact)."""
    per: tl.constexpr = 32 // BITS
    kn = k_valid[:, None] & n_valid[None, :]
    packed = tl.load(qw_ptr + (offs_k // per)[:, None] * stride_qk + offs_n[None, :], mask=kn, other=0)
    q = (packed >> ((offs_k % per) * BITS)[:, None]) & ((1 << BITS) - 1)
    if ROW_SCALES:  # the whole tile in one group: one row of scales and zeros
        g = k0 // group
        s = tl.load(s_ptr + g * stride_sg + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
    else:
        if G_IDX:  # activation order: each row's own group
            g = tl.load(gidx_ptr + offs_k, mask=k_valid, other=0)[:, None]
        else:
            g = (offs_k // group)[:, None]
        s = tl.load(s_ptr + g * stride_sg + offs_n[None, :], mask=kn, other=0.0).to(tl.float32)
    if E8M0:  # the exponent in a float32's exponent bits; 0 is 2^-127 (a subnormal)
        e = s.to(tl.int32)
        s = tl.where(e == 0, 5.877471754111438e-39, (e << 23).to(tl.float32, bitcast=True))
    if SCALE_2 == 1:
        s = s * tl.load(s2_ptr + offs_n, mask=n_valid, other=0.0)[None, :]
    elif SCALE_2 == 2:
        s = tl.math.div_rn(s, tl.load(s2_ptr + offs_n, mask=n_valid, other=1.0)[None, :])
    if CODEBOOK:  # a gather from the 2^BITS values (cached: the same few bytes for every tile)
        w = tl.load(cb_ptr + q, mask=kn, other=0.0) * s
    else:
        if ROW_SCALES:
            z = tl.load(z_ptr + g * stride_zg + offs_n, mask=n_valid, other=0).to(tl.float32)[None, :]
        else:
            z = tl.load(z_ptr + g * stride_zg + offs_n[None, :], mask=kn, other=0).to(tl.float32)
        w = (q.to(tl.float32) - z) * s
    return w


@triton.jit
def _int4_matmul_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, cb_ptr, s2_ptr, bias_ptr, y_ptr, gidx_ptr, M, N, K, group,
    stride_xm, stride_qk, stride_sg, stride_zg, stride_ym,
    ROW_SCALES: tl.constexpr, G_IDX: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    BITS: tl.constexpr, CODEBOOK: tl.constexpr, SCALE_2: tl.constexpr, E8M0: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_valid, n_valid = offs_m < M, offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_valid = offs_k < K
        a = tl.load(x_rows + offs_k[None, :], mask=m_valid[:, None] & k_valid[None, :], other=0.0)
        w = int4_tile(qw_ptr, s_ptr, z_ptr, gidx_ptr, cb_ptr, s2_ptr, offs_k, offs_n, k_valid, n_valid, k0, group,
                      stride_qk, stride_sg, stride_zg, ROW_SCALES, G_IDX, BITS, CODEBOOK,
                      SCALE_2, E8M0).to(a.dtype)  # float32, rounded once
        if UPCAST or IEEE:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc, mask=m_valid[:, None] & n_valid[None, :])


def int4_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group: int,
                bias: torch.Tensor | None, g_idx: torch.Tensor | None = None, bits: int = 4,
                codebook: torch.Tensor | None = None, scale_2: torch.Tensor | None = None,
                scale_2_divides: bool = False) -> torch.Tensor:
    """y [M, N] in x's dtype = x [M, K] @ W^T, W dequantized tile by tile (int4.py's layout;
    with `g_idx` each row's scale and zero are its group's, read row by row; with `codebook`
    each code's value times its scale, no zeros; with `scale_2` each scale times its column's, or
    divided by it)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    qweight, scales = qweight.contiguous(), scales.contiguous()
    zeros = zeros.contiguous() if zeros is not None else qweight  # (unread with a codebook)
    (m, k), n = x.shape, qweight.shape[1]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    block_m, block_n, block_k = _tile_m(m), tile(n, 64), 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int4_matmul_kernel[grid](
        x, qweight, scales, zeros, codebook.contiguous() if codebook is not None else scales,
        scale_2.contiguous() if scale_2 is not None else scales, bias.contiguous() if bias is not None else y, y,
        g_idx.to(torch.int32).contiguous() if g_idx is not None else y, m, n, k, max(group, 1),
        x.stride(0), qweight.stride(0), scales.stride(0), zeros.stride(0), y.stride(0),
        ROW_SCALES=g_idx is None and (group % block_k == 0 or group >= k), G_IDX=g_idx is not None,
        HAS_BIAS=bias is not None, UPCAST=INTERPRET, IEEE=x.dtype == torch.float32, BITS=bits,
        CODEBOOK=codebook is not None, SCALE_2=0 if scale_2 is None else 2 if scale_2_divides else 1,
        E8M0=scales.dtype == torch.uint8, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, **NO_FMA, **_GPU_OPTS,
    )
    return y
