"""An integer format's layer unpacked (GPTQ, AWQ, compressed-tensors, unpacked int8, bitsandbytes
4-bit): what `formats.int_weights` reads and `resident.fill_int4` repacks into the one packed
layout; and the checkpoints' 32-bit words unpacked (`unpack_words`, AWQ's column order)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# AWQ's interleave: value j of a packed word is column AWQ_ORDER[j] of its group of 8.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass(frozen=True)
class IntWeights:
    """An integer format's layer unpacked: values q [K, N] and zeros [G, N] (unsigned, on the
    same offset), scales [G, N] float32, each input row's group [K]. W^T = (q - zero) * scale;
    with a `codebook` (bitsandbytes 4-bit, float32 [2^bits]; zeros unused, 0)
    W^T = codebook[q] * scale. The FP4 formats also keep their group scales as they store them,
    `stored_scales` [G, N], 1 byte a group: NVFP4's float8 e4m3 with `scale_2` [N] (each column's
    float32 per-tensor scale: ModelOpt's fp8 * scale_2 or, with `scale_2_divides`,
    compressed-tensors' fp8 / global), MXFP4's uint8 E8M0 exponents (2^(e - 127)); a packed layer
    holds those and computes exactly what `scales` holds."""

    q: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    groups: torch.Tensor
    bits: int
    codebook: torch.Tensor | None = None
    stored_scales: torch.Tensor | None = None
    scale_2: torch.Tensor | None = None
    scale_2_divides: bool = False

    def dense(self) -> torch.Tensor:
        """W [N, K] float32 (exact: a small integer times a half-precision scale; with a codebook
        one float32 product, as bitsandbytes dequantizes)."""
        if self.codebook is not None:
            return (self.codebook[self.q.long()] * self.scales[self.groups]).t().contiguous()
        return ((self.q - self.zeros[self.groups]).to(torch.float32) * self.scales[self.groups]).t().contiguous()

    @property
    def group_size(self) -> int | None:
        """Rows per group when the groups are consecutive rows (row // size), else None
        (activation order: a permutation)."""
        k, num_groups = self.q.shape[0], self.scales.shape[0]
        size = -(-k // num_groups)
        return size if torch.equal(self.groups, torch.arange(k) // size) else None


def unpack_words(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words of 32 / bits unsigned values each (the first in the lowest bits) unpacked
    along `dim`: [.., W, ..] -> [.., W * 32 / bits, ..] int32."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    words = packed.to(torch.int32).unsqueeze(dim + 1)  # a new axis after `dim` for the values
    view = [1] * words.dim()
    view[dim + 1] = per_word
    values = (words >> shifts.view(view)) & ((1 << bits) - 1)
    shape = list(packed.shape)
    shape[dim] *= per_word
    return values.reshape(shape)


def awq_columns(values: torch.Tensor) -> torch.Tensor:
    """Columns unpacked in AWQ's interleaved order put back in order: column c of each group of 8
    is value AWQ_ORDER.index(c) of its word."""
    rows, cols = values.shape
    inverse = torch.tensor([AWQ_ORDER.index(c) for c in range(8)])
    return values.view(rows, cols // 8, 8)[:, :, inverse].reshape(rows, cols)
