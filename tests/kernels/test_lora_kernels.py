"""The LoRA delta kernels (interpreted on the CPU) and their torch reference against a float64
computation token by token: ragged segments, an empty one, zero-padded ranks, tokens of no
adapter left alone, bfloat16; B read through LoRAWeights' strided layout; and the graph steps'
fixed-shape form (RowSlotLoRA: every slot's products, all but the token's own zeroed, which adds
only exact zeros to the same terms).

Tolerance: a float32 dot product of n terms errs by at most n * eps times the sum of the terms'
magnitudes; the delta is two of them (K terms, then R), so the bound per element is
2 * (K + R) * eps * (|x| @ |a|.T) @ |b|.T, from the math, not from one machine's results."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from batonlm.kernels.lora import lora_delta_reference, lora_delta_triton
from batonlm.model_runner.lora import RowSlotLoRA


def _case(dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    t, k, n, r, slots = 37, 48, 40, 8, 4
    x = torch.randn(t, k, generator=g).to(dtype)
    a = torch.randn(slots, r, k, generator=g).to(dtype)
    b = torch.randn(slots, n, r, generator=g).to(dtype)
    a[2, 5:] = 0  # slot 2: rank 5, zero-padded to 8
    b[2, :, 5:] = 0
    # Segments: slot 1 (ragged, 19 tokens), slot 3 (empty), slot 2 (11), slot 1 again (1);
    # 6 tokens belong to no adapter.
    order = torch.randperm(t, generator=g)
    perm = order[:31]
    seg_slot, seg_start = [1, 3, 2, 1], [0, 19, 19, 30, 31]
    out = torch.randn(t, n, generator=g).to(dtype)
    return out, x, a, b, perm, seg_slot, seg_start


def _float64_truth(out, x, a, b, perm, seg_slot, seg_start):
    want, bound = out.double().clone(), torch.zeros_like(out, dtype=torch.float64)
    eps = torch.finfo(torch.float32).eps
    k, r = x.shape[1], a.shape[1]
    for s, slot in enumerate(seg_slot):
        for t in perm[seg_start[s] : seg_start[s + 1]].tolist():
            want[t] += (x[t].double() @ a[slot].double().T) @ b[slot].double().T
            bound[t] = 2 * (k + r) * eps * ((x[t].double().abs() @ a[slot].double().abs().T) @ b[slot].double().abs().T)
    return want, bound


def _as_stored(b: torch.Tensor) -> torch.Tensor:
    """`b` laid out as LoRAWeights stores it: a [slots, N, R] view of one [N, slots * R] matrix."""
    return b.permute(1, 0, 2).contiguous().permute(1, 0, 2)


@pytest.mark.parametrize("kernel", ["reference", "triton", "triton-stored-b", "row-slots"])
def test_the_delta_of_every_adapted_token_and_no_other(kernel):
    out, x, a, b, perm, seg_slot, seg_start = _case(torch.float32, 3)
    if kernel == "row-slots":  # slot 0 is the base model: zeros, as LoRAWeights holds it
        a[0], b[0] = 0, 0
    want, bound = _float64_truth(out, x, a, b, perm, seg_slot, seg_start)
    got = out.clone()
    if kernel == "reference":
        lora_delta_reference(got, x, a, b, perm, seg_slot, seg_start)
    elif kernel == "row-slots":  # the graph steps' form: every slot's products, the others' zeroed
        slots, rank, k = a.shape
        b_all = b.permute(1, 0, 2).reshape(b.shape[1], slots * rank)
        row_slots = torch.zeros(out.shape[0], dtype=torch.int64)
        for s, slot in enumerate(seg_slot):
            row_slots[perm[seg_start[s] : seg_start[s + 1]]] = slot
        weights = SimpleNamespace(slots=slots, a={(0, "qkv"): a}, b_all={(0, "qkv"): b_all})
        got = RowSlotLoRA(weights, row_slots).add(got, 0, "qkv", x)  # type: ignore[arg-type]
    else:
        b = _as_stored(b) if kernel == "triton-stored-b" else b
        lora_delta_triton(got, x, a, b, perm, torch.tensor(seg_slot), torch.tensor(seg_start), max_segment=19)
    untouched = torch.ones(out.shape[0], dtype=torch.bool)
    untouched[perm] = False
    assert torch.equal(got[untouched], out[untouched])  # no adapter: not a bit changed
    err = (got.double() - want).abs()
    # The output's own rounding (float32) adds half an ulp of the result.
    assert bool((err <= bound + torch.finfo(torch.float32).eps * want.abs()).all()), float((err - bound).max())


def test_bfloat16_matches_the_reference():
    out, x, a, b, perm, seg_slot, seg_start = _case(torch.bfloat16, 4)
    ref = lora_delta_reference(out.float().clone(), x.float(), a.float(), b.float(), perm, seg_slot, seg_start)
    got = lora_delta_triton(out.clone(), x, a, b, perm, torch.tensor(seg_slot), torch.tensor(seg_start), 19)
    # bfloat16 operands are exact in float32; the result is rounded to bfloat16 once (8 bits).
    assert torch.allclose(got.float(), ref, rtol=2 ** -7, atol=1e-2 * float(ref.abs().max()))


def test_nothing_to_do():
    out, x, a, b, _, _, _ = _case(torch.float32, 5)
    empty = torch.zeros(0, dtype=torch.int64)
    got = lora_delta_triton(out.clone(), x, a, b, empty, torch.tensor([1]), torch.tensor([0, 0]), 0)
    assert torch.equal(got, out)
