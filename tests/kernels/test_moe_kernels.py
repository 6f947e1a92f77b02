"""The mixture-of-experts formulations (batonlm/kernels/moe.py): the grouped CPU path, the dense
and gathered compiled-step paths and the Triton grouped GEMM (interpreted on the CPU) against the per-expert
loop in float64, on ragged expert loads — experts with many rows, one row, and none."""

from __future__ import annotations

import pytest
import torch

from batonlm.kernels.moe import (
    fused_moe_dense,
    fused_moe_gathered,
    fused_moe_grouped,
    fused_moe_reference,
    fused_moe_triton,
    moe_align,
)

FORMULATIONS = [fused_moe_grouped, fused_moe_dense, fused_moe_gathered, fused_moe_triton]


def _routing(g: torch.Generator, t: int, k: int, experts: int, used: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct top-k ids per token among the first `used` experts, skewed towards expert 0 (a
    hot expert beside cold and empty ones), and positive weights."""
    scores = torch.rand(t, used, generator=g) + torch.linspace(1.0, 0.0, used)
    ids = scores.topk(k, dim=1).indices
    return ids, torch.rand(t, k, generator=g, dtype=torch.float64) + 0.1


def _case(t: int, k: int, experts: int, used: int, hidden: int, inter: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hidden, generator=g, dtype=torch.float64)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g, dtype=torch.float64) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=g, dtype=torch.float64) / inter**0.5
    ids, weights = _routing(g, t, k, experts, used)
    return x, w13, w2, ids, weights


# (tokens, top-k, experts, experts used, hidden, intermediate): one token (decode), ragged
# prefills, sizes off the kernel's blocks, experts that get no row.
CASES = [(1, 2, 4, 4, 64, 32), (7, 2, 5, 4, 48, 40), (37, 3, 8, 6, 64, 24), (130, 4, 16, 9, 80, 72)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "t{}-k{}-e{}".format(*c))
@pytest.mark.parametrize("moe", FORMULATIONS, ids=lambda f: f.__name__)
def test_formulation_equals_the_per_expert_loop(moe, case):
    """float32 against float64: each output element is a sum of K products of two matmuls; the
    bound is float32's rounding of those sums' magnitudes (|x| |w13| |act| |w2| summed)."""
    x, w13, w2, ids, weights = _case(*case, seed=sum(case))
    want = fused_moe_reference(x, w13, w2, ids, weights)
    got = moe(x.float(), w13.float(), w2.float(), ids, weights.float())
    assert got.dtype == torch.float32 and got.shape == x.shape
    # Magnitude each element's result is built from, through both projections (|.| everywhere).
    scale = fused_moe_reference(x.abs(), w13.abs(), w2.abs(), ids, weights, act=lambda v: v.abs())
    depth = x.shape[1] + w2.shape[2] + ids.shape[1]  # the two matmuls' and the top-k sums' lengths
    bound = 4 * depth * torch.finfo(torch.float32).eps * (scale + 1e-30)
    err = (got.double() - want).abs()
    assert (err <= bound).all(), f"max err {err.max():.3g}, at bound {bound.flatten()[err.argmax()]:.3g}"


@pytest.mark.parametrize("moe", [fused_moe_grouped, fused_moe_dense, fused_moe_gathered], ids=lambda f: f.__name__)
def test_the_order_the_router_lists_experts_in_changes_nothing(moe):
    """The K outputs are added in ascending expert order (transformers' order), whatever order
    the router listed them in (float64, CPU formulations; the Triton path sorts with the same
    function, and the cases above route in score order)."""
    x, w13, w2, ids, weights = _case(33, 3, 6, 6, 32, 16, seed=5)
    shuffled = torch.stack([row[torch.randperm(3, generator=torch.Generator().manual_seed(i))]
                            for i, row in enumerate(ids)])
    perm = (shuffled[:, :, None] == ids[:, None, :]).float().argmax(-1)
    want = fused_moe_reference(x, w13, w2, ids, weights)
    got = moe(x, w13, w2, shuffled, weights.gather(1, perm))
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)


def test_alignment_groups_pairs_by_expert_in_padded_blocks():
    ids = torch.tensor([[3, 0], [0, 1], [3, 0], [1, 0]])  # expert 2 gets nothing
    sorted_ids, block_expert = moe_align(ids, num_experts=4, block_m=4)
    n = ids.numel()
    assert sorted_ids.numel() == -(-(n + 4 * 3) // 4) * 4 and sorted_ids.numel() % 4 == 0
    flat = ids.flatten()
    seen = []
    for b, e in enumerate(block_expert.tolist()):
        block = sorted_ids[4 * b : 4 * b + 4].tolist()
        real = [i for i in block if i < n]
        if e >= 4:
            assert not real  # blocks past the last group hold padding only
            continue
        assert all(flat[i] == e for i in real) and real == sorted(real)
        seen += real
    assert sorted(seen) == list(range(n))  # every pair once
    assert 2 not in block_expert.tolist()


def test_half_precision_runs_and_stays_close():
    """bfloat16 through every formulation (the products accumulate in float32 on the Triton
    path): within bfloat16's rounding of the float64 result."""
    x, w13, w2, ids, weights = _case(20, 2, 4, 4, 32, 32, seed=9)
    want = fused_moe_reference(x, w13, w2, ids, weights)
    for moe in FORMULATIONS:
        got = moe(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), ids, weights.bfloat16())
        assert got.dtype == torch.bfloat16
        err = (got.double() - want).abs().max().item()
        assert err < 0.05 * want.abs().max().item(), (moe.__name__, err)
