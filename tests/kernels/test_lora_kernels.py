"""The LoRA delta kernels (interpreted on the CPU) and their torch reference against a float64
computation token by token: ragged segments, an empty one, zero-padded ranks, tokens of no
adapter left alone, bfloat16.

Tolerance: a float32 dot product of n terms errs by at most n * eps times the sum of the terms'
magnitudes; the delta is two of them (K terms, then R), so the bound per element is
2 * (K + R) * eps * (|x| @ |a|.T) @ |b|.T, from the math, not from one machine's results."""

from __future__ import annotations

import pytest
import torch

from batonlm.kernels.lora import lora_delta_reference, lora_delta_triton


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


@pytest.mark.parametrize("kernel", ["reference", "triton"])
def test_the_delta_of_every_adapted_token_and_no_other(kernel):
    out, x, a, b, perm, seg_slot, seg_start = _case(torch.float32, 3)
    want, bound = _float64_truth(out, x, a, b, perm, seg_slot, seg_start)
    got = out.clone()
    if kernel == "reference":
        lora_delta_reference(got, x, a, b, perm, seg_slot, seg_start)
    else:
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
