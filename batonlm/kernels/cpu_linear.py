"""One row through a float32 projection on the CPU, y = x W^T: a C++ kernel (`cpu_linear.cpp`)
that streams each weight row once, and its torch reference (`F.linear`).

The decode step at one row reads every weight once (a stream at memory bandwidth or slower). On
a 2-core AVX-512 machine the 25M shape's projections (109 MB) took 2.3-2.7 ms a step through
this kernel, 2.4-2.6 through MKL's `F.linear`, 3.6-3.9 through oneDNN with packed weights and
4.3-4.9 through inductor's reduction (40-47 against 22-30 GB/s); on another machine MKL took
~10 ms at one row (docs/benchmarks.md). The kernel reads at bandwidth by construction on any of
them. Built like `cpu_attention` (once per machine, `toolchain.build_library`), it registers the
op `batonlm::row_linear` in C++, which the eager step and compiled graphs call alike. Where no
compiler works, `available()` is false and `linear` keeps its other paths.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from batonlm.kernels.toolchain import load_ops

SOURCE = Path(__file__).with_name("cpu_linear.cpp")


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] (one row) times weight [N, K] transposed -> [..., N]."""
    return F.linear(x, weight)


@functools.cache
def _kernel() -> bool:
    return load_ops(SOURCE, "projections use the BLAS")


# What `available` last answered: a graph being traced reads this (dynamo does not trace into the
# build), so whoever compiles calls `available` first (CompiledDecode does).
_available = False


def available() -> bool:
    """Whether the kernel runs here (built, or buildable, on this machine)."""
    global _available
    _available = _kernel()
    return _available


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """One row of x, a contiguous float32 weight on the CPU, and the kernel built (while a graph
    is traced: as `available` last found it)."""
    built = _available if torch.compiler.is_compiling() else available()
    return (x.numel() == x.shape[-1] and weight.dtype == torch.float32 and x.dtype == torch.float32
            and weight.device.type == "cpu" and weight.is_contiguous() and built)


def row_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`reference`'s result for one row (x [..., K] with one row in all), each weight read once:
    the op, which a compiled graph holds as it is (where `available()` said yes: else torch
    names the missing op)."""
    if not torch.compiler.is_compiling():  # loaded on first use (a graph is traced after `available`)
        _kernel()
    return torch.ops.batonlm.row_linear(x, weight)
