"""The grammar-mask kernel (interpreted on the CPU) against its torch reference, and the
reference against the meaning of the bits (xgrammar's own packing)."""

from __future__ import annotations

import pytest
import torch

from batonlm.kernels.token_bitmask import (
    apply_token_bitmask_packed,
    apply_token_bitmask_reference,
    apply_token_bitmask_triton,
)


def _pack(allowed: torch.Tensor) -> torch.Tensor:
    """[R, V] bool -> [R, ceil(V / 32)] int32, token t at bit t % 32 of word t // 32."""
    r, v = allowed.shape
    w = -(-v // 32)
    padded = torch.zeros((r, w * 32), dtype=torch.int64)
    padded[:, :v] = allowed.long()
    words = (padded.view(r, w, 32) << torch.arange(32)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 512, 1500])
def test_reference_masks_exactly_the_cleared_bits(vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=g)
    allowed = torch.rand(3, vocab, generator=g) < 0.3
    allowed[:, 0] = True
    rows = torch.tensor([4, 0, 2])
    out = logits.clone()
    apply_token_bitmask_reference(out, _pack(allowed), rows)
    want = logits.clone()
    for i, r in enumerate(rows.tolist()):
        want[r] = torch.where(allowed[i], logits[r], float("-inf"))
    assert torch.equal(out, want)


def test_reference_reads_xgrammar_bitmasks():
    xgr = pytest.importorskip("xgrammar")
    bitmask = xgr.allocate_token_bitmask(1, 100)
    xgr.reset_token_bitmask(bitmask)  # all allowed
    bitmask[0, 1] = 0b101  # tokens 32..63: only 32 and 34
    logits = torch.zeros(1, 100)
    apply_token_bitmask_reference(logits, bitmask, torch.tensor([0]))
    assert [t for t in range(32, 64) if logits[0, t] == 0] == [32, 34]
    assert torch.isfinite(logits[0, :32]).all() and torch.isfinite(logits[0, 64:]).all()
    want = torch.zeros(1, 100)
    xgr.apply_token_bitmask_inplace(want, bitmask)
    assert torch.equal(logits, want)


@pytest.mark.parametrize("vocab", [1, 33, 512, 2100])
def test_packed_bytes_equal_reference(vocab):
    """What the CPU device applies: the mask straight from the bytes that crossed the pipe."""
    g = torch.Generator().manual_seed(vocab + 1)
    logits = torch.randn(5, vocab, generator=g)
    allowed = torch.rand(3, vocab, generator=g) < 0.4
    bitmask = _pack(allowed)
    want, got = logits.clone(), logits.clone()
    apply_token_bitmask_reference(want, bitmask, torch.tensor([3, 0, 4]))
    apply_token_bitmask_packed(got, bitmask.numpy().tobytes(), bitmask.shape[1], [3, 0, 4])
    assert torch.equal(got, want)


@pytest.mark.parametrize("vocab", [7, 512, 2100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_equals_reference(vocab, dtype):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=g).to(dtype)
    allowed = torch.rand(4, vocab, generator=g) < 0.5
    rows = torch.tensor([5, 1, 3, 0])
    want, got = logits.clone(), logits.clone()
    apply_token_bitmask_reference(want, _pack(allowed), rows)
    apply_token_bitmask_triton(got, _pack(allowed), rows)
    assert torch.equal(got, want)
