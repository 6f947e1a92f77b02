"""Mixture-of-experts over FP8 experts in blocks (batonlm/kernels/moe_fp8.py): the grouped FP8
GEMM (Triton, interpreted on the CPU) against float64, and the four formulations of the whole
layer (grouped torch reference, dense, gathered, Triton) against a float64 per-expert loop.

Bounds (eps = 2^-23, float32's):
- One grouped GEMM given FP8 inputs: every product is exact in float64; float32 sums of K terms
  and the scale multiplications err by at most (K + 4) eps sum |a| |w| (as test_quant_kernels.py).
- The whole layer: the gated intermediate is quantized to FP8 again. Computed in another order
  (float32 here, float64 in the truth) it can sit on the other side of an FP8 rounding boundary,
  so a code may differ by one step, 2^-3 of the value at most for e4m3; through the down
  projection and the routing weights that is 2^-3 sum_k w_k (|g_k| @ |W2_k|^T), plus the float32
  rounding of the magnitudes. A wrong expert, block or scale errs by the size of y itself.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from kernel_helpers import calibrated_input_scales, compiled_only, interpreted_only, static_experts_truth  # noqa: E402

from batonlm.kernels import _triton_moe  # noqa: E402
from batonlm.kernels.moe import moe_align, sort_by_expert  # noqa: E402
from batonlm.kernels.moe_fp8 import (  # noqa: E402
    fused_moe_fp8_dense,
    fused_moe_fp8_gathered,
    fused_moe_fp8_grouped,
    fused_moe_fp8_triton,
)
from batonlm.kernels.quant import (  # noqa: E402
    dequantize_fp8_block,
    per_token_group_quant_fp8_reference,
    static_quant_fp8_reference,
)

E4M3 = torch.float8_e4m3fn
EPS32 = torch.finfo(torch.float32).eps
FORMULATIONS = [pytest.param(fused_moe_fp8_grouped, id="grouped"), pytest.param(fused_moe_fp8_dense, id="dense"),
                pytest.param(fused_moe_fp8_gathered, id="gathered"),
                pytest.param(fused_moe_fp8_triton, id="triton", marks=interpreted_only)]


def _fp8(g: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    return (torch.randn(shape, generator=g) * 64).clamp(-448, 448).to(E4M3)


def _case(t: int, k: int, experts: int, hidden: int, inter: int, block: tuple[int, int], seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hidden, generator=g) * 2
    w13_q, w2_q = _fp8(g, (experts, 2 * inter, hidden)), _fp8(g, (experts, hidden, inter))
    # Scales that differ 10x from block to block (or channel to channel): a neighbour's shows.
    if block is None:
        w13_shape, w2_shape = (experts, 2 * inter), (experts, hidden)
    else:
        bn, bk = block
        w13_shape, w2_shape = (experts, 2 * inter // bn, -(-hidden // bk)), (experts, -(-hidden // bn), -(-inter // bk))
    w13_s = (torch.rand(w13_shape, generator=g) * 9 + 1) / (64 * hidden**0.5)
    w2_s = (torch.rand(w2_shape, generator=g) * 9 + 1) / (64 * inter**0.5)
    scores = torch.rand(t, experts, generator=g) + torch.linspace(1.0, 0.0, experts)  # a hot expert, cold ones
    ids = scores.topk(k, dim=1).indices
    weights = torch.rand(t, k, generator=g) + 0.1
    return x, w13_q, w13_s, w2_q, w2_s, ids, weights


def _dequantized(x: torch.Tensor, block) -> torch.Tensor:
    """x's rows quantized per group of the block's K (per channel: the whole row) and back."""
    group = block[1] if block is not None else x.shape[1]
    q, s = per_token_group_quant_fp8_reference(x, group)
    return q.double() * s.double().repeat_interleave(group, dim=1)[:, : x.shape[1]]


def _weight(w_q: torch.Tensor, w_s: torch.Tensor, block) -> torch.Tensor:
    if block is None:
        return w_q.double() * w_s.double()[:, None]
    return dequantize_fp8_block(w_q, w_s, block, torch.float64)


def _truth(x, w13_q, w13_s, w2_q, w2_s, block, ids, weights):
    """(y, the bound's magnitude): the per-expert loop in float64 from the FP8 codes."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    mag = torch.zeros(x.shape, dtype=torch.float64)
    x_d = _dequantized(x, block)
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e, w = int(ids[t, slot]), float(weights[t, slot])
            w13, w2 = _weight(w13_q[e], w13_s[e], block), _weight(w2_q[e], w2_s[e], block)
            h = x_d[t] @ w13.T
            gate, up = h.chunk(2)
            g = F.silu(gate) * up
            g_d = _dequantized(g.float()[None], block)[0]
            out[t] += w * (g_d @ w2.T)
            mag[t] += w * ((g.abs() + g_d.abs()) @ w2.abs().T)
    return out, mag


# (tokens, top-k, experts, hidden, intermediate, block): decode's one token, ragged loads, a hidden
# size with a partial last K block, DeepSeek's 128 x 128 blocks, per-channel scales (None).
CASES = [(1, 2, 4, 64, 32, (16, 16)), (7, 3, 5, 80, 32, (32, 32)), (19, 2, 6, 96, 64, (32, 64)),
         (5, 2, 3, 256, 128, (128, 128)), (1, 2, 4, 64, 32, None), (13, 3, 5, 72, 40, None)]


@interpreted_only
@pytest.mark.parametrize("case", CASES[:3] + CASES[5:], ids=lambda c: "t{}-k{}-e{}-h{}-{}".format(*c))
def test_the_grouped_fp8_gemm_equals_float64(case):
    x, w13_q, w13_s, _, _, ids, weights = _case(*case, seed=sum(case[:5]))
    t, k = ids.shape
    block = case[5]
    x_q, x_s = per_token_group_quant_fp8_reference(x, block[1] if block is not None else x.shape[1])
    ids_sorted, _ = sort_by_expert(ids, weights)
    sorted_ids, block_expert = moe_align(ids_sorted, w13_q.shape[0], _triton_moe.BLOCK_M)
    got = _triton_moe.grouped_gemm_fp8(x_q, x_s, w13_q, w13_s, block, sorted_ids, block_expert, t * k, k,
                                       torch.float32)
    x_d = _dequantized(x, block)
    for pair in range(t * k):
        e = int(ids_sorted.flatten()[pair])
        w = _weight(w13_q[e], w13_s[e], block)
        want, mag = x_d[pair // k] @ w.T, x_d[pair // k].abs() @ w.abs().T
        assert ((got[pair].double() - want).abs() <= (x.shape[1] + 4) * EPS32 * mag).all(), pair


@pytest.mark.parametrize("case", CASES, ids=lambda c: "t{}-k{}-e{}-h{}-{}".format(*c))
@pytest.mark.parametrize("moe", FORMULATIONS)
def test_each_formulation_is_the_fp8_experts_layer(moe, case):
    x, w13_q, w13_s, w2_q, w2_s, ids, weights = _case(*case, seed=sum(case[:5]))
    block = case[5]
    got = moe(x, w13_q, w13_s, w2_q, w2_s, block, ids, weights)
    assert got.dtype == torch.float32 and got.shape == x.shape
    want, mag = _truth(x, w13_q, w13_s, w2_q, w2_s, block, ids, weights)
    depth = x.shape[1] + w2_q.shape[2] + ids.shape[1]
    bound = 2.0**-3 * mag + 4 * depth * EPS32 * mag + 1e-30
    err = (got.double() - want).abs()
    assert (err <= bound).all(), f"max err {err.max():.3g} at bound {bound.flatten()[err.argmax()]:.3g}"


def _static_truth(x, w13_q, w13_s, w2_q, w2_s, a13, a2, ids, weights):
    """(y, bound) in float64 with each expert's static scales (`static_experts_truth`)."""
    experts = range(w13_q.shape[0])
    w13 = torch.stack([_weight(w13_q[e], w13_s[e], None) for e in experts])
    w2 = torch.stack([_weight(w2_q[e], w2_s[e], None) for e in experts])

    def quantized(v: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return static_quant_fp8_reference(v, scale)[0].double() * float(scale)

    return static_experts_truth(x, w13, w2, a13, a2, ids, weights, quantized)


@pytest.mark.parametrize("case", [(1, 2, 4, 64, 32), (13, 3, 5, 72, 40), (21, 2, 6, 96, 48)],
                         ids=lambda c: "t{}-k{}-e{}-h{}-i{}".format(*c))
@pytest.mark.parametrize("moe", FORMULATIONS)
def test_static_activation_scales_are_each_experts_own(moe, case):
    """Per-channel FP8 experts with static input scales (AutoFP8's and llm-compressor's FP8
    Mixtral): each expert quantizes its rows by its own calibrated scales, gate/up and down."""
    x, w13_q, w13_s, w2_q, w2_s, ids, weights = _case(*case, None, seed=sum(case))
    w13 = torch.stack([_weight(w13_q[e], w13_s[e], None) for e in range(w13_q.shape[0])])
    a13, a2 = calibrated_input_scales(x, w13, 448.0, seed=sum(case))
    got = moe(x, w13_q, w13_s, w2_q, w2_s, None, ids, weights, input_scales=(a13, a2))
    want, bound = _static_truth(x, w13_q, w13_s, w2_q, w2_s, a13, a2, ids, weights)
    err = (got.double() - want).abs()
    assert (err <= bound).all(), f"max err {err.max():.3g} at bound {bound.flatten()[err.argmax()]:.3g}"
    # Each expert's own scales: the next expert's (or the largest, as other engines take) miss.
    for wrong in ((a13.roll(1), a2), (a13, a2.roll(1)), (a13.max().expand_as(a13).contiguous(), a2)):
        other = moe(x, w13_q, w13_s, w2_q, w2_s, None, ids, weights, input_scales=wrong)
        assert ((other.double() - want).abs() > bound).any()


def test_a_bad_shape_is_named():
    x, w13_q, w13_s, w2_q, w2_s, ids, weights = _case(3, 2, 4, 64, 32, (16, 16), seed=1)
    with pytest.raises(ValueError, match="^input_scales:"):
        fused_moe_fp8_grouped(x, w13_q, w13_s, w2_q, w2_s, (16, 16), ids, weights, input_scales=(w13_s, w2_s))
    with pytest.raises(ValueError, match="^w13_scale:"):
        fused_moe_fp8_grouped(x, w13_q, w13_s[:, :-1], w2_q, w2_s, (16, 16), ids, weights)
    with pytest.raises(ValueError, match="^w2_q:"):
        fused_moe_fp8_grouped(x, w13_q, w13_s, w2_q[:, :, :-16], w2_s[:, :, :1], (16, 16), ids, weights)


# --- compiled on a GPU with FP8 (compute capability 8.9+): DeepSeek-V3-sized experts ---------------


@pytest.mark.gpu
@compiled_only
@pytest.mark.parametrize("t", [1, 64])
def test_gpu_fp8_moe(t):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9")
    x, w13_q, w13_s, w2_q, w2_s, ids, weights = _case(t, 8, 32, 1024, 512, (128, 128), seed=t)
    args = [v.cuda() for v in (x, w13_q, w13_s, w2_q, w2_s)]
    x_c, rest = args[0].to(torch.bfloat16), args[1:]
    ids, weights = ids.cuda(), weights.cuda()
    got = fused_moe_fp8_triton(x_c, *rest, (128, 128), ids, weights)
    want = fused_moe_fp8_grouped(x_c, *rest, (128, 128), ids, weights)
    from batonlm.kernels.moe import fused_moe_reference

    w13, w2 = (torch.stack([dequantize_fp8_block(q[e], s[e], (128, 128), torch.float64) for e in range(q.shape[0])])
               for q, s in ((rest[0], rest[1]), (rest[2], rest[3])))
    # |g| <= |gate| |up| <= (|x| @ |Wg|)(|x| @ |Wu|): the magnitude the requantization scales, through |W2|.
    mag = fused_moe_reference(x_c.double().abs(), w13.abs(), w2.abs(), ids, weights.double(), act=lambda v: v)
    # bfloat16 outputs: one rounding of each of the K weighted sums, besides the FP8 requantization.
    bound = (2.0**-3 + 8 * 2.0**-8) * mag + 1e-3 * want.double().abs().max()
    assert ((got.double() - want.double()).abs() <= bound).all()


@pytest.mark.gpu
@compiled_only
@pytest.mark.parametrize("t", [1, 64])
def test_gpu_fp8_moe_static_scales(t):
    """Mixtral-FP8-like experts (per-channel weights, each expert's static input scales) in
    bfloat16: the Triton path against the torch reference on the device, as the block test bounds it."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9")
    x, w13_q, w13_s, w2_q, w2_s, ids, weights = _case(t, 2, 8, 2048, 1024, None, seed=t)
    w13 = torch.stack([_weight(w13_q[e], w13_s[e], None) for e in range(8)])
    scales = tuple(a.cuda() for a in calibrated_input_scales(x, w13, 448.0, seed=t))
    rest = [v.cuda() for v in (w13_q, w13_s, w2_q, w2_s)]
    x_c, ids, weights = x.bfloat16().cuda(), ids.cuda(), weights.cuda()
    got = fused_moe_fp8_triton(x_c, *rest, None, ids, weights, input_scales=scales)
    want = fused_moe_fp8_grouped(x_c, *rest, None, ids, weights, input_scales=scales)
    from batonlm.kernels.moe import fused_moe_reference

    w2 = torch.stack([_weight(w2_q[e], w2_s[e], None) for e in range(8)]).cuda()
    mag = fused_moe_reference(x_c.double().abs(), w13.cuda().abs(), w2.abs(), ids, weights.double(), act=lambda v: v)
    bound = (2.0**-3 + 8 * 2.0**-8) * mag + 1e-3 * want.double().abs().max()
    assert ((got.double() - want.double()).abs() <= bound).all()
