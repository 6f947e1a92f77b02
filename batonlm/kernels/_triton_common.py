"""Pieces shared by the Triton kernels of batonlm.kernels (imported on first use of a kernel)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice


def _interpreting() -> bool:
    knobs = getattr(triton, "knobs", None)  # triton >= 3.4
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")


INTERPRET: bool = _interpreting()
# Compiled tl.exp is ex2.approx(x * log2 e), whose error grows with |x|; libdevice's exp and log
# are CUDA's expf and logf, which torch's CUDA references use, so probabilities match to the bit
# far more often. The interpreter has no libdevice and uses numpy, which is precise already.
PRECISE: tl.constexpr = tl.constexpr(not INTERPRET)
# Launch option of every kernel: no contraction of a * b + c into an FMA, so that such sums round
# twice as torch's do (and the same whatever Triton's default, which changes in 3.10).
NO_FMA = {"enable_fp_fusion": False}


def device_fn(fn: Callable) -> Callable:
    """triton.jit for a helper called from kernels.

    The interpreter re-patches triton.language on every device-function call (~1.5 ms, most of
    a small kernel's time); the launch has patched it already, so call the rewritten function."""
    jitted = triton.jit(fn)
    rewrite = getattr(jitted, "rewrite", None)
    if not INTERPRET or rewrite is None:
        return jitted
    return functools.wraps(fn)(lambda *args, **kwargs: rewrite()(*args, **kwargs))


def tile(n: int, cap: int) -> int:
    """A block covering n elements: the next power of two, at least 16 (tl.dot's least), at most
    `cap`."""
    return max(16, min(cap, triton.next_power_of_2(n)))


def block_size(vocab_size: int) -> int:
    """Elements per block: the interpreter pays per operation rather than per element, so it
    gets large blocks; a GPU gets blocks that keep a search tile in registers."""
    return tile(vocab_size, 8192 if INTERPRET else 1024)


def rows_f32(x: torch.Tensor) -> torch.Tensor:
    """A float32 [B, V] tensor with contiguous rows (what the kernels index)."""
    if x.dim() != 2:
        raise ValueError(f"expected a [B, V] tensor, got shape {tuple(x.shape)}")
    x = x.to(torch.float32)
    return x if x.stride(1) == 1 else x.contiguous()


def vec(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype).contiguous()


@device_fn
def exp(x):
    if PRECISE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@device_fn
def tanh(x):
    """CUDA's tanhf compiled; interpreted, 2 / (1 + e^-2x) - 1 (within ~2 ulps of 1 absolute:
    attention's soft-capping multiplies it by the cap, far inside the kernels' score bound)."""
    if PRECISE:
        return libdevice.tanh(x)
    else:
        return 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0


@device_fn
def log(x):
    if PRECISE:
        return libdevice.log(x)
    else:
        return tl.log(x)


@device_fn
def row_max_argmax(row_ptr, V, BLOCK: tl.constexpr):
    """Max and first maximal index of a row (torch.argmax's tie rule)."""
    best = tl.full([], float("-inf"), tl.float32)
    best_i = tl.full([], 0, tl.int32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf"))
        m, i = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
        better = m > best  # strict: an earlier block keeps a tie
        best_i = tl.where(better, start + i, best_i)
        best = tl.where(better, m, best)
    return best, best_i


@device_fn
def exp_sum(row_ptr, V, temp, z_max, BLOCK: tl.constexpr):
    """sum_i exp(x_i / temp - z_max), the softmax denominator."""
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf"))
        acc += exp(tl.math.div_rn(x, temp) - z_max)
    return tl.sum(acc, axis=0)
