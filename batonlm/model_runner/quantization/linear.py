"""Linear layers whose weights stay quantized on the device: FP8 (block-wise, or per channel),
int8 with int8 activations (W8A8-int8, and bitsandbytes' LLM.int8) and int4 (grouped), each a
matmul of batonlm/kernels/quant.py, int4.py, int8.py or llm_int8.py (Triton on CUDA, the torch references elsewhere). `resident.py` puts them in a model in place of its float projections
and fills them from the checkpoint."""

from __future__ import annotations

import torch
from torch import nn

from batonlm.kernels.fp4 import FP4_INPUTS
from batonlm.kernels.input_quant import INPUT_QUANTS
from batonlm.kernels.int4 import STORED_SCALES, dequantize_int4, int4_dequant_matmul
from batonlm.kernels.int8 import (
    int8_scaled_matmul,
    per_token_quant_int8,
    per_token_quant_int8_asym,
    static_quant_int8,
    weight_sums,
)
from batonlm.kernels.llm_int8 import llm_int8_matmul, llm_int8_quant
from batonlm.kernels.quant import (
    MIN_SCALE,
    dequantize_fp8_block,
    fp8_block_matmul,
    fp8_block_product,
    fp8_scaled_matmul,
    fp8_scaled_product,
    per_token_group_quant_fp8,
    per_token_quant_fp8,
    static_quant_fp8,
)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Fp8Linear(nn.Module):
    """y = x W^T (+ bias) with W [N, K] in FP8 e4m3 and float32 scales: one per `block` of
    [bn, bk] (DeepSeek-V3, Qwen3-FP8), or one per output channel. Activations are quantized
    per token (per token and group of bk with blocks), or with `static` a checkpoint's one
    input scale. `amax_ub` / `min_scale`: per-token activations' amax cap and least scale
    (FBGEMM FP8's; kernels/quant.py).

    On the CPU (no FP8 GEMM: the torch reference multiplies in float32) `finish_load` keeps the
    reference's float32 weight operand (`weight_f`: the codes, dequantized by their blocks with
    blocks), so a call converts the activations alone: the same operations on the same values,
    the same outputs, 4 bytes a weight more."""

    weight_q: torch.Tensor
    weight_scale: torch.Tensor
    input_scale: torch.Tensor | None
    weight_f: torch.Tensor | None

    def __init__(self, n: int, k: int, block: tuple[int, int] | None, static: bool, bias: bool, *,
                 amax_ub: float | None = None, min_scale: float = MIN_SCALE) -> None:
        super().__init__()
        self.n, self.k, self.block = n, k, block
        self.amax_ub, self.min_scale = amax_ub, min_scale
        self.register_buffer("weight_q", torch.empty(n, k, dtype=torch.float8_e4m3fn))
        shape = (_cdiv(n, block[0]), _cdiv(k, block[1])) if block else (n,)
        self.register_buffer("weight_scale", torch.empty(shape, dtype=torch.float32))
        self.register_buffer("input_scale", torch.empty(1, dtype=torch.float32) if static else None)
        self.register_buffer("weight_f", None, persistent=False)
        self.bias = nn.Parameter(torch.empty(n)) if bias else None

    def finish_load(self) -> None:
        """Once the checkpoint is in: on the CPU, the float32 weight operand (see the class)."""
        if self.weight_q.device.type != "cpu":
            return
        w = self.weight_q
        self.weight_f = dequantize_fp8_block(w, self.weight_scale, self.block, torch.float32) if self.block else w.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.k)
        if self.block is not None:
            x_q, x_scale = per_token_group_quant_fp8(flat, self.block[1])
            if self.weight_f is not None:
                y = fp8_block_product(x_q, x_scale, self.weight_f, self.block[1], x.dtype)
            else:
                y = fp8_block_matmul(x_q, x_scale, self.weight_q, self.weight_scale, self.block, x.dtype)
            y = y if self.bias is None else y + self.bias
        else:
            if self.input_scale is not None:
                x_q, x_scale = static_quant_fp8(flat, self.input_scale), self.input_scale
            else:
                x_q, x_scale = per_token_quant_fp8(flat, amax_ub=self.amax_ub, min_scale=self.min_scale)
            if self.weight_f is not None:
                xs, ws = x_scale.reshape(-1, 1), self.weight_scale.reshape(-1, 1)
                y = fp8_scaled_product(x_q, xs, self.weight_f, ws, x.dtype, self.bias)
            else:
                y = fp8_scaled_matmul(x_q, x_scale, self.weight_q, self.weight_scale, x.dtype, self.bias)
        return y.reshape(*x.shape[:-1], self.n)


class Int8Linear(nn.Module):
    """y = x W^T (+ bias) with W [N, K] int8 and one float32 scale per output channel, the
    activations quantized to int8 per token (or with `static` by a checkpoint's one input
    scale) and multiplied in int32: W8A8-int8 (llm-compressor's W8A8 / INT8 scheme). `asym`:
    the activations with a zero point (per token, or the checkpoint's `input_zero_point`), taken
    off the int32 sum by the weight's row sums (`weight_sum`)."""

    weight_q: torch.Tensor
    weight_scale: torch.Tensor
    input_scale: torch.Tensor | None
    input_zero_point: torch.Tensor | None
    weight_sum: torch.Tensor | None

    def __init__(self, n: int, k: int, static: bool, bias: bool, asym: bool = False) -> None:
        super().__init__()
        self.n, self.k = n, k
        self.register_buffer("weight_q", torch.empty(n, k, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.empty(n, dtype=torch.float32))
        self.register_buffer("input_scale", torch.empty(1, dtype=torch.float32) if static else None)
        self.register_buffer("input_zero_point", torch.empty(1, dtype=torch.int32) if static and asym else None)
        self.register_buffer("weight_sum", torch.empty(n, dtype=torch.int32) if asym else None)
        self.bias = nn.Parameter(torch.empty(n)) if bias else None

    def finish_load(self) -> None:
        """Once the checkpoint is in: with zero points, the weight rows' sums (this rank's columns)."""
        if self.weight_sum is not None:
            self.weight_sum.copy_(weight_sums(self.weight_q))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.k)
        x_zero = self.input_zero_point
        if self.input_scale is not None:
            x_q, x_scale = static_quant_int8(flat, self.input_scale, x_zero), self.input_scale
        elif self.weight_sum is not None:
            x_q, x_scale, x_zero = per_token_quant_int8_asym(flat)
        else:
            x_q, x_scale = per_token_quant_int8(flat)
        y = int8_scaled_matmul(x_q, x_scale, self.weight_q, self.weight_scale, x.dtype, self.bias, x_zero=x_zero,
                               w_sum=self.weight_sum)
        return y.reshape(*x.shape[:-1], self.n)


class LlmInt8Linear(nn.Module):
    """bitsandbytes' 8-bit layer (LLM.int8): W [N, K] int8 with one float32 scale per output row
    (its absmax: W = code * scale / 127); activations quantized to int8 per row, the outlier
    columns (an element of at least `threshold`) multiplied in float (kernels/llm_int8.py)."""

    weight_q: torch.Tensor
    weight_scale: torch.Tensor

    def __init__(self, n: int, k: int, threshold: float, bias: bool) -> None:
        super().__init__()
        self.n, self.k, self.threshold = n, k, threshold
        self.register_buffer("weight_q", torch.empty(n, k, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.empty(n, dtype=torch.float32))
        self.bias = nn.Parameter(torch.empty(n)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.k)
        x_q, rs, cols = llm_int8_quant(flat, self.threshold)
        y = llm_int8_matmul(flat, x_q, rs, cols, self.weight_q, self.weight_scale, self.bias)
        return y.reshape(*x.shape[:-1], self.n)


class PackedIntLinear(nn.Module):
    """y = x W^T (+ bias) with W^T [K, N] as `bits`-bit integers (4 or 8) packed along K
    (`qweight` [K / (32 / bits), N]), a zero and a scale per group of `group_size` input rows and
    output column (GPTQ, AWQ and compressed-tensors W4A16 / W8A16, repacked into this one layout
    on load). `group_size` 0: GPTQ's activation order, each input row's group in `g_idx` [K] (of
    `groups` groups). With a `codebook` (bitsandbytes' NF4 / FP4, NVFP4's E2M1, float32 [2^bits]) a
    weight is codebook[q] * its group's scale, and there are no zeros. With `fp4_input` (NVFP4
    W4A4: the format whose arithmetic its activations follow, a key of FP4_INPUTS) the input is
    first quantized to FP4 and back with `fp4_input_scale`, the layer's calibrated scale as that
    format stores it (kernels/fp4.py). With `input_quant` (a key of INPUT_QUANTS,
    kernels/input_quant.py: MXFP8 in its tool's rule, or FP8 / int8 per token for llm-compressor's
    W4AFP8 / W4A8) the input is first quantized so and back. With `pre_quant_scale` (ModelOpt's int4
    AWQ) the input is first multiplied by it, per input feature. `stored_scales` "float8" (NVFP4): the scales are float8
    e4m3, each times its column's float32 `scale_2` (ModelOpt's) or, `scale_2_divides`, divided by
    it (compressed-tensors' global scale): 1 byte per 16 weights instead of 4; "e8m0" (MXFP4,
    MXFP8): uint8 exponents, 1 byte per 32 weights.

    On the CPU (where only layers quantizing their inputs stay packed, NVFP4 W4A4, MXFP8, W4AFP8:
    weight-only formats are dequantized on load) `finish_load` keeps the reference's weight operand, the codes dequantized into the model
    dtype (`weight_f`), as `Fp8Linear` does: a call then quantizes the activations alone, the same
    operations on the same values (the reference dequantizes at every call, 20x the float step's
    time at one row here: docs/benchmarks.md), 4 bytes a weight more."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    g_idx: torch.Tensor | None
    codebook: torch.Tensor | None
    fp4_input_scale: torch.Tensor | None
    pre_quant_scale: torch.Tensor | None
    scale_2: torch.Tensor | None
    weight_f: torch.Tensor | None

    def __init__(self, n: int, k: int, group_size: int, dtype: torch.dtype, bias: bool, groups: int = 0,
                 bits: int = 4, codebook: bool = False, fp4_input: str = "", stored_scales: str = "",
                 scale_2_divides: bool = False, input_quant: str = "", pre_quant_scale: bool = False) -> None:
        super().__init__()
        self.n, self.k, self.group_size, self.bits = n, k, group_size, bits
        # (in the layer's dtype, as ModelOpt multiplies: no cast per call)
        self.register_buffer("pre_quant_scale", torch.empty(k, dtype=dtype) if pre_quant_scale else None)
        if group_size != 0:
            groups = 1 if group_size == -1 else _cdiv(k, group_size)
        self.register_buffer("qweight", torch.empty(_cdiv(k, 32 // bits), n, dtype=torch.int32))
        # float32: a checkpoint's half-precision scales exactly (bfloat16 would round fp16's).
        self.register_buffer("scales", torch.empty(groups, n, dtype=STORED_SCALES[stored_scales]))
        self.register_buffer("scale_2", torch.empty(n, dtype=torch.float32) if stored_scales == "float8" else None)
        self.register_buffer("zeros", None if codebook else torch.empty(groups, n, dtype=torch.uint8))
        self.register_buffer("g_idx", torch.empty(k, dtype=torch.int32) if group_size == 0 else None)
        self.register_buffer("codebook", torch.empty(1 << bits, dtype=torch.float32) if codebook else None)
        self.register_buffer("fp4_input_scale", torch.empty(1, dtype=torch.float32) if fp4_input else None)
        self.fp4_quant = FP4_INPUTS[fp4_input] if fp4_input else None
        self.input_fake_quant = INPUT_QUANTS[input_quant] if input_quant else None
        self.scale_2_divides, self.dtype = scale_2_divides, dtype
        self.register_buffer("weight_f", None, persistent=False)
        self.bias = nn.Parameter(torch.empty(n, dtype=dtype)) if bias else None

    def finish_load(self) -> None:
        """Once the checkpoint is in: on the CPU, the dequantized weight operand (see the class)."""
        if self.qweight.device.type != "cpu":
            return
        self.weight_f = dequantize_int4(self.qweight, self.scales, self.zeros, self.group_size, self.k, self.dtype,
                                        self.g_idx, self.bits, self.codebook, self.scale_2, self.scale_2_divides)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.k)
        if self.pre_quant_scale is not None:
            flat = flat * self.pre_quant_scale
        if self.fp4_input_scale is not None and self.fp4_quant is not None:
            flat = self.fp4_quant(flat, self.fp4_input_scale)
        if self.input_fake_quant is not None:
            flat = self.input_fake_quant(flat)
        if self.weight_f is not None and self.weight_f.dtype == flat.dtype:  # the reference's operand, kept
            y = nn.functional.linear(flat, self.weight_f, None if self.bias is None else self.bias.to(flat.dtype))
            return y.reshape(*x.shape[:-1], self.n)
        y = int4_dequant_matmul(flat, self.qweight, self.scales, self.zeros, self.group_size, self.bias, self.g_idx,
                                self.bits, self.codebook, self.scale_2, self.scale_2_divides)
        return y.reshape(*x.shape[:-1], self.n)
