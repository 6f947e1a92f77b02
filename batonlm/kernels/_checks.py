"""Argument checks the quantized kernels' entry points share (quant.py, int4.py, int8.py): each
bad argument is one ValueError naming it, what was expected and what came; and their small
shape helpers."""

from __future__ import annotations

import torch


def fail(name: str, what: str, got: object) -> ValueError:
    return ValueError(f"{name}: expected {what}, got {got}")


def check_2d(t: torch.Tensor, name: str) -> None:
    if t.dim() != 2:
        raise fail(name, "a 2-D tensor", f"shape {tuple(t.shape)}")


def check_scale(t: torch.Tensor, name: str, shapes: list[tuple[int, ...]], dtype: torch.dtype = torch.float32,
                ) -> None:
    """A scale (float32; or with `dtype` another per-row quantity, e.g. int32 zero points) of one
    of `shapes`."""
    if t.dtype != dtype:
        raise fail(name, str(dtype).removeprefix("torch."), t.dtype)
    if tuple(t.shape) not in shapes:
        raise fail(name, " or ".join(str(list(s)) for s in shapes), f"shape {tuple(t.shape)}")


def shape_of(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """What a dequantization computes in for a result in `dtype`: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32
