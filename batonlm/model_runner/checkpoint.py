"""A checkpoint's tensors by name, across its safetensors shards: shapes from the headers, a
tensor or a slice of it read alone (`Checkpoint`). A quantized checkpoint is read through
`quantization/dequantized.py`'s view of it, which has the same interface."""

from __future__ import annotations

import math
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
                "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}


class Checkpoint:
    """The open safetensors files of a checkpoint (a context manager: the files stay open
    inside it). `read` counts the bytes it reads (`bytes_read`)."""

    def __init__(self, files: list[Path]) -> None:
        self.files = files
        self._stack = ExitStack()
        self._handles: list[Any] = []
        self._where: dict[str, Any] = {}
        self.bytes_read = 0

    def __enter__(self) -> Checkpoint:
        for f in self.files:
            sf = self._stack.enter_context(safe_open(str(f), framework="pt"))
            self._handles.append(sf)
            for name in sf.keys():
                self._where[name] = sf
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def names_by_file(self) -> list[tuple[Path, list[str]]]:
        """Each file and the tensor names it holds, in the files' order."""
        return [(f, list(sf.keys())) for f, sf in zip(self.files, self._handles)]

    def names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._where[name].get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The safetensors dtype name (F32, BF16, F8_E4M3, I32, ...)."""
        return str(self._where[name].get_slice(name).get_dtype())

    def nbytes(self, name: str) -> int:
        """The tensor's size in the checkpoint."""
        return math.prod(self.shape(name)) * _DTYPE_BYTES[self.dtype(name)]

    def get(self, name: str) -> torch.Tensor:
        t = self._where[name].get_tensor(name)
        self.bytes_read += t.numel() * t.element_size()
        return t

    def read(self, name: str, dim: int = 0, start: int = 0, count: int | None = None) -> torch.Tensor:
        """Elements [start, start + count) of `name` along `dim` (0 or 1; count None: all),
        read alone, not the whole tensor."""
        full = self.shape(name)[dim] if self.shape(name) else 0
        if count is None or (start == 0 and count == full):
            return self.get(name)
        part = self._where[name].get_slice(name)
        t = part[start : start + count] if dim == 0 else part[:, start : start + count]
        self.bytes_read += t.numel() * t.element_size()
        return t
