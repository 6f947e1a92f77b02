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


def apply_token_bitmask_packed(logits: torch.Tensor, packed: bytes, words: int, rows: list[int]) -> None:
    """`apply_token_bitmask_reference` straight from the bytes of a little-endian int32 bitmask
    (what crosses the pipe), on the CPU: numpy unpacks the bits in one call and each row is one
    in-place fill — a few ops instead of the reference's dozen."""
    import numpy as np

    vocab = logits.shape[1]
    bits = np.unpackbits(np.frombuffer(packed, dtype=np.uint8), bitorder="little")
    banned = torch.from_numpy(bits.reshape(len(rows), words * 32)[:, :vocab] == 0)
    for i, row in enumerate(rows):
        logits[row].masked_fill_(banned[i], float("-inf"))


def apply_token_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """`apply_token_bitmask_reference` as one launch: a program per (mask row, vocabulary block)."""
    from batonlm.kernels import _triton_token_bitmask

    _triton_token_bitmask.apply(logits, bitmask, rows)
