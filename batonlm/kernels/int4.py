"""Weight-only integer kernels (a plain-torch reference beside its Triton twin in
`_triton_quant.py`; `use_triton` None picks Triton for CUDA tensors, torch otherwise).

int4 (and int8) weight-only: the one layout GPTQ, AWQ and compressed-tensors checkpoints are
repacked into, `bits` 4 or 8 (p = 32 / bits codes per word: 8 or 4).
- `qweight` int32 [ceil(K / p), N]: row j packs input rows pj .. pj + p - 1 of column n, code i
  (bits i*bits .. i*bits + bits - 1, i = 0 the least significant) holding row pj + i, unsigned
  0..2^bits - 1 (rows past K are 0). `pack_int4` / `unpack_int4` convert from / to a [K, N]
  tensor of values.
- `scales` [ceil(K / G), N], float32 or the activation dtype; `zeros` [ceil(K / G), N], any
  integer dtype, unpacked values 0..2^bits - 1 (2^(bits-1) everywhere for a symmetric
  checkpoint). G is the group size; -1 means one group of all K rows.
- W[n, k] = (q[k, n] - zeros[k // G, n]) * scales[k // G, n] (or with `g_idx` [K], GPTQ's
  activation order, group g_idx[k] of any number of groups); with a `codebook` (float32
  [2^bits], bitsandbytes' NF4 / FP4 tables) W[n, k] = codebook[q[k, n]] * scales[k // G, n]
  and no zeros. With `scale_2` (float32 [N], one per output column: NVFP4's per-tensor scale,
  `scales` then float8 e4m3 group scales, 1 byte each) a group's scale is the float32 product
  scales[k // G, n] * scale_2[n] (ModelOpt's `weight_scale_2`), or with `scale_2_divides` the
  quotient scales[k // G, n] / scale_2[n] (compressed-tensors' global scale), rounded once,
  before it multiplies the code's value. `scales` uint8 are E8M0 exponents (MXFP4's, 1 byte a
  group): the scale is 2^(e - 127), exact in float32:
  `dequantize_int4` gives W [N, K]
  (nn.Linear's layout); `int4_dequant_matmul` computes x @ W^T in x's dtype, W rounded to it
  (the Triton kernel dequantizes each tile exactly in float32, rounds it once to x's dtype and
  multiplies with float32 accumulation; the reference rounds the same W the same way).
"""

from __future__ import annotations

import torch

from batonlm.kernels._checks import cdiv, check_2d, compute_dtype, fail, shape_of

INT_BITS = (4, 8)
# The group scales' dtype in a packed layer: float32, or as the FP4 formats store them (1 byte):
# NVFP4's float8 e4m3 (with `scale_2`), MXFP4's E8M0 exponents.
STORED_SCALES = {"": torch.float32, "float8": torch.float8_e4m3fn, "e8m0": torch.uint8}


def _per_word(bits: int) -> int:
    if bits not in INT_BITS:
        raise fail("bits", "4 or 8", bits)
    return 32 // bits


def pack_int4(q: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """q [K, N] integers 0..2^bits - 1 -> qweight int32 [ceil(K / p), N] (the layout above)."""
    check_2d(q, "q")
    per = _per_word(bits)
    if q.is_floating_point() or q.is_complex():
        raise fail("q", "an integer tensor", q.dtype)
    if q.numel() and (int(q.min()) < 0 or int(q.max()) >= 1 << bits):
        raise fail("q", f"values in 0..{(1 << bits) - 1}", f"{int(q.min())}..{int(q.max())}")
    k, n = q.shape
    rows = torch.nn.functional.pad(q.to(torch.int64), (0, 0, 0, cdiv(k, per) * per - k)).view(-1, per, n)
    shifts = bits * torch.arange(per, device=q.device).view(1, per, 1)
    packed = (rows << shifts).sum(dim=1)  # 0 .. 2^32 - 1, as int32's two's complement below
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_int4(qweight: torch.Tensor, k: int, bits: int = 4) -> torch.Tensor:
    """qweight int32 [ceil(K / p), N] -> uint8 [K, N] values 0..2^bits - 1."""
    check_2d(qweight, "qweight")
    per = _per_word(bits)
    if qweight.dtype != torch.int32:
        raise fail("qweight", "int32", qweight.dtype)
    if qweight.shape[0] != cdiv(k, per):
        raise fail("qweight", f"{cdiv(k, per)} rows (ceil(K / {per}) for K = {k})", f"shape {shape_of(qweight)}")
    shifts = bits * torch.arange(per, dtype=torch.int32, device=qweight.device).view(1, per, 1)
    q = (qweight.unsqueeze(1) >> shifts) & ((1 << bits) - 1)  # the arithmetic shift's sign bits are masked off
    return q.reshape(-1, qweight.shape[1])[:k].to(torch.uint8)


def _check_int4(qweight, scales, zeros, group_size: int, k: int, g_idx: torch.Tensor | None = None,
                bits: int = 4, codebook: torch.Tensor | None = None, scale_2: torch.Tensor | None = None) -> int:
    """The group size in rows (-1 -> K; with `g_idx`, each row's own group: 0)."""
    check_2d(qweight, "qweight")
    n, per = qweight.shape[1], _per_word(bits)
    if qweight.dtype != torch.int32 or qweight.shape[0] != cdiv(k, per):
        raise fail("qweight", f"int32 [{cdiv(k, per)}, N] (ceil(K / {per}) rows, K = {k}, {bits} bits)",
                    f"{qweight.dtype} {shape_of(qweight)}")
    if g_idx is not None:
        if g_idx.is_floating_point() or shape_of(g_idx) != (k,):
            raise fail("g_idx", f"an integer [{k}] tensor (each input row's group)", f"{g_idx.dtype} {shape_of(g_idx)}")
        groups, g = scales.shape[0] if scales.dim() == 2 else -1, 0
    else:
        if group_size != -1 and group_size < 1:
            raise fail("group_size", "a positive number of rows or -1 (one group)", group_size)
        g = max(k if group_size == -1 else group_size, 1)
        groups = cdiv(k, g)
    if not (scales.is_floating_point() or scales.dtype == torch.uint8) or shape_of(scales) != (groups, n):
        raise fail("scales", f"a floating-point or uint8 (E8M0) [{groups}, {n}] tensor",
                   f"{scales.dtype} {shape_of(scales)}")
    if scale_2 is not None and (scale_2.dtype != torch.float32 or shape_of(scale_2) != (n,)):
        raise fail("scale_2", f"float32 [{n}] (each output column's)", f"{scale_2.dtype} {shape_of(scale_2)}")
    if codebook is not None:
        if codebook.dtype != torch.float32 or shape_of(codebook) != (1 << bits,):
            raise fail("codebook", f"float32 [{1 << bits}] (each code's value)", f"{codebook.dtype} {shape_of(codebook)}")
    elif zeros is None or zeros.is_floating_point() or shape_of(zeros) != (groups, n):
        got = "None" if zeros is None else f"{zeros.dtype} {shape_of(zeros)}"
        raise fail("zeros", f"an integer [{groups}, {n}] tensor (unpacked)", got)
    return g


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int, k: int,
                    dtype: torch.dtype = torch.bfloat16, g_idx: torch.Tensor | None = None,
                    bits: int = 4, codebook: torch.Tensor | None = None,
                    scale_2: torch.Tensor | None = None, scale_2_divides: bool = False) -> torch.Tensor:
    """W [N, K] in `dtype` (nn.Linear's layout): computed in float32 (exact: a 4- or 8-bit
    integer times a scale of at most 16 bits, but float32 scales, which round once) or float64.
    `g_idx` [K]: each input row's group (GPTQ's activation order), instead of row // group_size.
    `codebook`: each code's value (float32 [2^bits]), times the scale (no zeros; one float32
    rounding, as bitsandbytes dequantizes). `scale_2`: each column's factor of its group scales
    (their float32 products, or with `scale_2_divides` quotients, rounded once, are the scales)."""
    g = _check_int4(qweight, scales, zeros, group_size, k, g_idx, bits, codebook, scale_2)
    c = compute_dtype(dtype)
    if scales.dtype == torch.uint8:  # E8M0 exponents
        scales = e8m0_scales(scales)
    if scale_2 is not None:
        scales = scales.to(torch.float32) / scale_2 if scale_2_divides else scales.to(torch.float32) * scale_2
    groups = g_idx.long() if g_idx is not None else torch.arange(k, device=qweight.device) // g
    q = unpack_int4(qweight, k, bits)
    if codebook is not None:
        w = codebook.to(c)[q.long()] * scales[groups].to(c)  # [K, N]
    else:
        assert zeros is not None
        w = (q.to(c) - zeros[groups].to(c)) * scales[groups].to(c)  # [K, N]
    return w.T.contiguous().to(dtype)


def e8m0_scales(exponents: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 exponents -> their float32 scales 2^(e - 127) (exact; 0 is 2^-127, subnormal)."""
    return torch.ldexp(torch.ones(exponents.shape, device=exponents.device), exponents.to(torch.int32) - 127)


def _check_int4_matmul(x, qweight, scales, zeros, group_size: int, bias, g_idx=None, bits: int = 4,
                       codebook=None, scale_2=None) -> int:
    """The group size in rows (-1 -> K; 0 with `g_idx`)."""
    check_2d(x, "x")
    if not x.is_floating_point():
        raise fail("x", "a floating-point tensor", x.dtype)
    g = _check_int4(qweight, scales, zeros, group_size, x.shape[1], g_idx, bits, codebook, scale_2)
    if bias is not None and shape_of(bias) != (qweight.shape[1],):
        raise fail("bias", f"shape [{qweight.shape[1]}]", f"shape {shape_of(bias)}")
    return g


def int4_dequant_matmul_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                                  zeros: torch.Tensor | None, group_size: int, bias: torch.Tensor | None = None,
                                  g_idx: torch.Tensor | None = None, bits: int = 4,
                                  codebook: torch.Tensor | None = None,
                                  scale_2: torch.Tensor | None = None, scale_2_divides: bool = False) -> torch.Tensor:
    _check_int4_matmul(x, qweight, scales, zeros, group_size, bias, g_idx, bits, codebook, scale_2)
    w = dequantize_int4(qweight, scales, zeros, group_size, x.shape[1], x.dtype, g_idx, bits, codebook, scale_2,
                        scale_2_divides)
    return torch.nn.functional.linear(x, w, None if bias is None else bias.to(x.dtype))


def int4_dequant_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                        group_size: int, bias: torch.Tensor | None = None, g_idx: torch.Tensor | None = None,
                        bits: int = 4, codebook: torch.Tensor | None = None, scale_2: torch.Tensor | None = None,
                        scale_2_divides: bool = False, *, use_triton: bool | None = None) -> torch.Tensor:
    """y [M, N] in x's dtype = x [M, K] @ W^T (+ bias), W from `qweight`, `scales`, `zeros`
    (the layout above, of `bits` 4 or 8; group_size 32, 64, 128, ... or -1; or `g_idx` [K],
    each row's group), or from `qweight`, `scales` and a `codebook` (zeros None), the scales
    times (or divided by) each column's `scale_2` where given."""
    if not (x.is_cuda if use_triton is None else use_triton):
        return int4_dequant_matmul_reference(x, qweight, scales, zeros, group_size, bias, g_idx, bits, codebook,
                                             scale_2, scale_2_divides)
    g = _check_int4_matmul(x, qweight, scales, zeros, group_size, bias, g_idx, bits, codebook, scale_2)
    from batonlm.kernels import _triton_quant

    return _triton_quant.int4_matmul(x, qweight, scales, zeros, g, bias, g_idx, bits, codebook, scale_2,
                                     scale_2_divides)
