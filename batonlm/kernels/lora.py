"""LoRA deltas of a batch mixing adapters, a torch reference and its Triton twin.

The batch's adapted tokens are grouped by adapter: `perm` lists their flat indices, segment by
segment (`seg_start[s]` .. `seg_start[s + 1]`), segment s using adapter slot `seg_slot[s]`.
For every such token t: out[t] += (x[t] @ a[slot].T) @ b[slot].T, a [slots, R, K] (shrink),
b [slots, N, R] (expand, scaled already); tokens of no segment are left as they are. Ragged
segments, empty ones and zero-padded ranks are all fine.
"""

from __future__ import annotations

import torch


def lora_delta_reference(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, perm: torch.Tensor,
                         seg_slot: list[int], seg_start: list[int]) -> torch.Tensor:
    """In place on out [T, N]; x [T, K]. One shrink and one expand matmul per segment."""
    for s, slot in enumerate(seg_slot):
        idx = perm[seg_start[s] : seg_start[s + 1]]
        if idx.numel():
            out.index_add_(0, idx, (x.index_select(0, idx) @ a[slot].T) @ b[slot].T)
    return out


def lora_delta_triton(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, perm: torch.Tensor,
                      seg_slot: torch.Tensor, seg_start: torch.Tensor, max_segment: int) -> torch.Tensor:
    """`lora_delta_reference` as two launches (a shrink into a float32 [T', R] buffer, an expand
    added into `out`), a program per (segment, block of its tokens, block of outputs);
    `max_segment` is the longest segment's length (a host fact: no device sync)."""
    from batonlm.kernels import _triton_lora

    return _triton_lora.lora_delta(out, x, a, b, perm, seg_slot, seg_start, max_segment)
