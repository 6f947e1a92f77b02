"""The float projections' matmul, y = x W^T (+ b), and the form it takes in the compiled CPU
decode step.

A decode step at a few rows is a chain of matrix-vector products: it reads every weight once
and does two flops per weight read, so it runs at memory bandwidth or not at all. The BLAS
behind `F.linear` on the CPU does not get there at these shapes: on a 2-core AVX-512 machine
the 25M model's projections (110 MB of fp32 weights) take ~10 ms a step at 1 row through MKL,
~11 GB/s against ~45 GB/s that a plain read reaches (benchmarks/decode_step.py measures both).
Written as a broadcast product summed over the input features, inductor generates a
vectorised, threaded reduction that streams the weights at ~35 GB/s: ~3 ms. Only for one row:
at 2 to 8 rows inductor vectorised the same product over the rows (a scalar loop over the
features; 165-180 ms a step on the 25M shape, benchmarks/decode_step.py), so more rows take
oneDNN's packed GEMM below (4.8-5.8 ms at 2-8 rows).

Only inside `torch.compile` on the CPU (the compiled decode step): eager, the broadcast product
would be materialised. Both are now behind `kernels/cpu_linear.py` for one row of a weight of
ROW_KERNEL_MIN_ELEMENTS or more, eager and compiled: a C++ kernel that streams each weight row
once (on another 2-core AVX-512 machine, where MKL's one row ran at bandwidth and inductor's
reduction at half of it, the kernel matched MKL: 2.3-2.7 vs 4.3-4.9 ms for the 25M shape).

Everywhere else on the CPU, a weight that `pack` has seen goes through oneDNN with the weight
reordered once into its blocked layout (`batonlm::packed_linear`, an opaque op inside the
compiled step): on the 25M shape 7.2 vs 13.9 ms a step's projections at 16 rows, 19 vs 31 ms at
64, 5.1 vs 9.8 ms at one row eager. The packed copy is a second copy of the weights, so
`pack` is for models whose weights fit PACK_MAX_BYTES, and for matrices of PACK_MIN_ELEMENTS
or more (below, oneDNN's fixed cost per call outweighs it); the rest, and every other device,
use `F.linear`.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from batonlm.kernels import cpu_linear

# Weights packed for oneDNN at most (their packed copy doubles them): a model larger than this
# (a 1B-parameter model in fp32 is 4 GB) keeps one copy and the BLAS.
PACK_MAX_BYTES = 2 << 30
# A weight smaller than this stays with the BLAS: oneDNN's call costs ~13 us more, which only a
# matrix this large earns back (1 thread, 1 / 16 / 64 rows: [512, 512] 23 / 114 / 367 us through
# MKL vs 31 / 93 / 331 us; [1536, 512] 86 / 375 / 1197 vs 61 / 260 / 1098 us; [64, 64] 2 vs 15 us).
PACK_MIN_ELEMENTS = 1 << 19
# One row through a weight this large or larger goes through kernels/cpu_linear.py (a C++ op, ~2 us
# a call); smaller ones stay in the graph's own fused reduction: stories260K's matrices (at most
# 32K elements) through the kernel made its compiled one-row step 0.40 ms against 0.36.
ROW_KERNEL_MIN_ELEMENTS = 1 << 18

# Packed weights by the plain weight's (data pointer, shape): the op receives the plain weight
# (its shape and identity) and multiplies by its packed twin.
_packed: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}
# Set by the first `pack`: from then on CPU projections go through the op, which finds the
# packed twin at run time (a weight's address is not known while torch.compile traces).
_packing = False


def _key(weight: torch.Tensor) -> tuple[int, tuple[int, ...]]:
    return weight.data_ptr(), tuple(weight.shape)


def _packable(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or weight.dim() != 2 or not torch.backends.mkldnn.is_available():
        return False
    # bfloat16 where the CPU has its instructions (AVX-512 BF16 / AMX): 3.2 vs 6.1 ms for the
    # 25M shape's projections at 16 rows in float32, 7.9 vs 15.0 at 64, 2.3 vs 4.7 at one row.
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack(weights: list[torch.Tensor], batch_hint: int = 64, min_elements: int = PACK_MIN_ELEMENTS) -> int:
    """Reorder `weights` (CPU, float32 or bfloat16, at least `min_elements`) for oneDNN's GEMM; returns the
    bytes packed (0 when they exceed PACK_MAX_BYTES or oneDNN is missing: `linear` then stays
    on F.linear)."""
    weights = [w for w in weights if _packable(w) and w.numel() >= min_elements]
    total = sum(w.numel() * w.element_size() for w in weights)
    if not weights or total > PACK_MAX_BYTES:
        return 0
    global _packing
    _packing = True
    with torch.no_grad():
        for w in weights:
            key = _key(w)
            _packed[key] = torch.ops.mkldnn._reorder_linear_weight(w.detach(), batch_hint)
            # Gone with the weight: a later tensor at the same address is not mistaken for it.
            weakref.finalize(w, _packed.pop, key, None)
    return total


def unpack(weights: list[torch.Tensor]) -> None:
    """Forget `weights`' packed twins (they go through F.linear again)."""
    for w in weights:
        _packed.pop(_key(w), None)


def _onednn(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, bias, "none", [], "")
    return y.reshape(*x.shape[:-1], n)


@torch.library.custom_op("batonlm::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T (+ b) through oneDNN with `weight`'s packed twin (F.linear for a weight never packed)."""
    packed = _packed.get(_key(weight))
    return F.linear(x, weight, bias) if packed is None else _onednn(x, packed, bias, weight.shape[0])


@packed_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear; on the CPU, one row of a large weight through the kernel, else the reduction
    (compiled, one row) or oneDNN (a packed weight)."""
    if x.device.type != "cpu":
        return F.linear(x, weight, bias)
    one_row = x.numel() == x.shape[-1] and weight.dtype == torch.float32
    if one_row and weight.numel() >= ROW_KERNEL_MIN_ELEMENTS and cpu_linear.supports(x, weight):
        y = cpu_linear.row_linear(x, weight)
        return y if bias is None else y + bias
    if torch.compiler.is_compiling():
        if one_row:  # the reduction (25M: 3.0 vs 9.8 ms via MKL on one machine)
            y = (weight * x.reshape(1, -1)).sum(-1).reshape(*x.shape[:-1], weight.shape[0])
            return y if bias is None else y + bias
        # The packed twin is looked up when the graph runs (its address is unknown while tracing).
        return torch.ops.batonlm.packed_linear(x, weight, bias) if _packing else F.linear(x, weight, bias)
    # Eager: straight to oneDNN (the custom op's dispatch would add ~40 us a call).
    packed = _packed.get(_key(weight)) if _packing else None
    return F.linear(x, weight, bias) if packed is None else _onednn(x, packed, bias, weight.shape[0])


class Linear(nn.Linear):
    """nn.Linear (same parameters, same checkpoint names) through `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
