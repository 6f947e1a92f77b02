"""Mixture-of-experts over W8A8 int8 experts (batonlm/kernels/moe_int8.py): the grouped torch
reference against a float64 per-expert loop, and the dense, gathered and Triton formulations
(interpreted) against it bit for bit.

Why bit for bit: a row's int8 codes and scale depend on that row alone, its integer products are
exact, and every formulation then multiplies the same int32 sums by the same two scales in the
same order (int8.py), gates in torch and requantizes with quantizers equal to the bit
(test_int8_kernels.py): the same float operations on the same values.

Against float64: the integer sums are exact; float32 rounds the scaling and the gating (4 eps of
the magnitudes through both matmuls and the top-k sum). The gated intermediate is requantized:
computed in float64 it may round to the neighbouring code, one step (its scale, amax / 127.5)
per element, through |W2|.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from kernel_helpers import calibrated_input_scales, compiled_only, interpreted_only, static_experts_truth  # noqa: E402

from batonlm.kernels.int8 import per_token_quant_int8_reference, static_quant_int8_reference  # noqa: E402
from batonlm.kernels.moe_int8 import (  # noqa: E402
    fused_moe_int8_dense,
    fused_moe_int8_gathered,
    fused_moe_int8_grouped,
    fused_moe_int8_triton,
)

EPS32 = torch.finfo(torch.float32).eps


def _case(t: int, k: int, experts: int, hidden: int, inter: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hidden, generator=g) * 2
    w13_q = torch.randint(-128, 128, (experts, 2 * inter, hidden), generator=g, dtype=torch.int8)
    w2_q = torch.randint(-128, 128, (experts, hidden, inter), generator=g, dtype=torch.int8)
    w13_s = (torch.rand(experts, 2 * inter, generator=g) * 9 + 1) / (128 * hidden**0.5)
    w2_s = (torch.rand(experts, hidden, generator=g) * 9 + 1) / (128 * inter**0.5)
    scores = torch.rand(t, experts, generator=g) + torch.linspace(1.0, 0.0, experts)  # a hot expert, cold ones
    ids = scores.topk(k, dim=1).indices
    weights = torch.rand(t, k, generator=g) + 0.1
    return x, w13_q, w13_s, w2_q, w2_s, ids, weights


# (tokens, top-k, experts, hidden, intermediate): decode's one token, ragged loads, odd sizes.
CASES = [(1, 2, 4, 64, 32), (7, 3, 5, 80, 48), (19, 2, 6, 96, 40), (33, 4, 8, 72, 56)]


def _truth(x, w13_q, w13_s, w2_q, w2_s, ids, weights):
    """(y, bound) in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    bound = torch.zeros(x.shape, dtype=torch.float64)
    q, s = per_token_quant_int8_reference(x)
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e, w = int(ids[t, slot]), float(weights[t, slot])
            w13 = w13_q[e].double() * w13_s[e].double()[:, None]
            w2 = w2_q[e].double() * w2_s[e].double()[:, None]
            x_d = q[t].double() * float(s[t])
            gate, up = (x_d @ w13.T).chunk(2)
            g = F.silu(gate) * up
            gq, gs = per_token_quant_int8_reference(g.float()[None])
            out[t] += w * ((gq[0].double() * float(gs)) @ w2.T)
            mag = (x_d.abs() @ w13.abs().T).chunk(2)
            step = g.abs().max() / 127.5
            depth = x.shape[1] + w2.shape[1] + ids.shape[1]
            bound[t] += w * (step * w2.abs().sum(dim=1) + 4 * depth * EPS32 * ((mag[0] * mag[1]) @ w2.abs().T
                                                                          + 2 * g.abs() @ w2.abs().T))
    return out, bound


@pytest.mark.parametrize("case", CASES, ids=lambda c: "t{}-k{}-e{}-h{}-i{}".format(*c))
def test_the_reference_is_the_w8a8_experts_layer(case):
    x, w13_q, w13_s, w2_q, w2_s, ids, weights = _case(*case, seed=sum(case))
    got = fused_moe_int8_grouped(x, w13_q, w13_s, w2_q, w2_s, ids, weights)
    assert got.dtype == torch.float32 and got.shape == x.shape
    want, bound = _truth(x, w13_q, w13_s, w2_q, w2_s, ids, weights)
    err = (got.double() - want).abs()
    assert (err <= bound).all(), f"max err {err.max():.3g} at bound {bound.flatten()[err.argmax()]:.3g}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: "t{}-k{}-e{}-h{}-i{}".format(*c))
@pytest.mark.parametrize("moe", [pytest.param(fused_moe_int8_dense, id="dense"),
                                 pytest.param(fused_moe_int8_gathered, id="gathered"),
                                 pytest.param(fused_moe_int8_triton, id="triton", marks=interpreted_only)])
def test_every_formulation_is_the_reference_bit_for_bit(moe, case):
    x, w13_q, w13_s, w2_q, w2_s, ids, weights = _case(*case, seed=sum(case))
    want = fused_moe_int8_grouped(x, w13_q, w13_s, w2_q, w2_s, ids, weights)
    assert torch.equal(moe(x, w13_q, w13_s, w2_q, w2_s, ids, weights), want)


def _static_truth(x, w13_q, w13_s, w2_q, w2_s, ids, weights, input_scales):
    """(y, bound) in float64 with each expert's static scales (`static_experts_truth`): the
    integer sums exact."""
    w13 = w13_q.double() * w13_s.double()[:, :, None]
    w2 = w2_q.double() * w2_s.double()[:, :, None]

    def quantized(v: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return static_quant_int8_reference(v, scale)[0].double() * float(scale)

    return static_experts_truth(x, w13, w2, *input_scales, ids, weights, quantized)


def _static(case):
    x, w13_q, w13_s, w2_q, w2_s, ids, weights = _case(*case, seed=sum(case))
    a13, a2 = calibrated_input_scales(x, w13_q.double() * w13_s.double()[:, :, None], 127.5, seed=sum(case))
    return (x, w13_q, w13_s, w2_q, w2_s, ids, weights), (a13, a2)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "t{}-k{}-e{}-h{}-i{}".format(*c))
def test_static_activation_scales_are_each_experts_own(case):
    """W8A8 int8 experts with static input scales (llm-compressor's W8A8 with calibrated
    activations): each expert quantizes its rows by its own scales, gate/up and down."""
    args, scales = _static(case)
    got = fused_moe_int8_grouped(*args, input_scales=scales)
    want, bound = _static_truth(*args, input_scales=scales)
    err = (got.double() - want).abs()
    assert (err <= bound).all(), f"max err {err.max():.3g} at bound {bound.flatten()[err.argmax()]:.3g}"
    # Each expert's own scales: the next expert's (or the largest, as other engines take) miss.
    a13, a2 = scales
    for wrong in ((a13.roll(1), a2), (a13, a2.roll(1)), (a13.max().expand_as(a13).contiguous(), a2)):
        assert ((fused_moe_int8_grouped(*args, input_scales=wrong).double() - want).abs() > bound).any()


@pytest.mark.parametrize("case", CASES, ids=lambda c: "t{}-k{}-e{}-h{}-i{}".format(*c))
@pytest.mark.parametrize("moe", [pytest.param(fused_moe_int8_dense, id="dense"),
                                 pytest.param(fused_moe_int8_gathered, id="gathered"),
                                 pytest.param(fused_moe_int8_triton, id="triton", marks=interpreted_only)])
def test_every_formulation_with_static_scales_is_the_reference_bit_for_bit(moe, case):
    args, scales = _static(case)
    assert torch.equal(moe(*args, input_scales=scales), fused_moe_int8_grouped(*args, input_scales=scales))


def test_a_bad_shape_is_named():
    x, w13_q, w13_s, w2_q, w2_s, ids, weights = _case(3, 2, 4, 64, 32, seed=1)
    with pytest.raises(ValueError, match="^input_scales:"):
        fused_moe_int8_grouped(x, w13_q, w13_s, w2_q, w2_s, ids, weights, input_scales=(w13_s, w2_s))
    with pytest.raises(ValueError, match="^w2_scale:"):
        fused_moe_int8_grouped(x, w13_q, w13_s, w2_q, w2_s[:, :-1], ids, weights)


@pytest.mark.gpu
@compiled_only
@pytest.mark.parametrize("t", [1, 64])
def test_gpu_int8_moe(t):
    """Qwen3-30B-A3B-sized experts in bfloat16: the int8 tensor cores sum exactly, so the Triton
    path is the torch reference on the same device bit for bit."""
    x, w13_q, w13_s, w2_q, w2_s, ids, weights = _case(t, 8, 16, 2048, 768, seed=t)
    args = [v.cuda() for v in (w13_q, w13_s, w2_q, w2_s, ids)] + [weights.bfloat16().cuda()]
    xb = x.bfloat16().cuda()
    got = fused_moe_int8_triton(xb, *args[:4], args[4], args[5])
    assert torch.equal(got, fused_moe_int8_grouped(xb, *args[:4], args[4], args[5]))


@pytest.mark.gpu
@compiled_only
@pytest.mark.parametrize("t", [1, 64])
def test_gpu_int8_moe_static_scales(t):
    """Each expert's static input scales: the Triton path (pair rows quantized by their expert's
    scale) is the torch reference on the same device bit for bit."""
    (x, w13_q, w13_s, w2_q, w2_s, ids, weights), scales = _static((t, 8, 16, 2048, 768))
    args = [v.cuda() for v in (w13_q, w13_s, w2_q, w2_s, ids)] + [weights.bfloat16().cuda()]
    scales = tuple(a.cuda() for a in scales)
    xb = x.bfloat16().cuda()
    got = fused_moe_int8_triton(xb, *args[:4], args[4], args[5], input_scales=scales)
    assert torch.equal(got, fused_moe_int8_grouped(xb, *args[:4], args[4], args[5], input_scales=scales))
