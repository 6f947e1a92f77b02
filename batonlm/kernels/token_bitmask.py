"""Grammar masks: a bitmask of allowed tokens applied to logits, a torch reference and its
Triton twin.

`bitmask[r]` is row r's allowed set, packed 32 tokens to an int32 word (token t is bit t % 32
of word t // 32, little-endian bit order, as xgrammar fills it); `rows[r]` is the logits row it
applies to. Every token whose bit is 0 gets -inf; rows not named are left as they are.
"""

from __future__ import annotations

import torch


def apply_token_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: logits [B, V] float; bitmask [R, W] int32 (W >= ceil(V / 32)); rows [R] int64."""
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1  # [R, W, 32]
    allowed = bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def apply_token_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """`apply_token_bitmask_reference` as one launch: a program per (mask row, vocabulary block)."""
    from batonlm.kernels import _triton_token_bitmask

    _triton_token_bitmask.apply(logits, bitmask, rows)
