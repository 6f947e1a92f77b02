"""Mixture-of-experts over int4 experts (batonlm/kernels/moe_int4.py): the grouped torch
reference, the dense and gathered formulations and the Triton grouped GEMM (interpreted on the CPU) against the
float64 per-expert loop over the weights the codes mean, on ragged expert loads.

Bound: each weight is exact in float64 ((q - zero) * scale); float32 rounds it once (2^-24
relative) and sums the two matmuls and the top-k in float32, as the float experts' test bounds
(4 * depth * eps of the magnitudes |x| |W13| |act| |W2|). bfloat16 activations round each weight
to bfloat16 (2^-8) and every output of the first matmul (2^-8 again, through the second).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from kernel_helpers import compiled_only, interpreted_only  # noqa: E402

from batonlm.kernels.int4 import pack_int4  # noqa: E402
from batonlm.kernels.moe import fused_moe_reference  # noqa: E402
from batonlm.kernels.moe_int4 import (  # noqa: E402
    Int4Weights,
    fused_moe_int4_dense,
    fused_moe_int4_gathered,
    fused_moe_int4_grouped,
    fused_moe_int4_triton,
)

FORMULATIONS = [pytest.param(fused_moe_int4_grouped, id="grouped"), pytest.param(fused_moe_int4_dense, id="dense"),
                pytest.param(fused_moe_int4_gathered, id="gathered"),
                pytest.param(fused_moe_int4_triton, id="triton", marks=interpreted_only)]
EPS32 = torch.finfo(torch.float32).eps


def _weights(g: torch.Generator, experts: int, k: int, n: int, group: int, sym: bool,
             ordered: bool = False, bits: int = 4) -> tuple[Int4Weights, torch.Tensor]:
    """Random codes, zeros and half-precision scales; and the meaning W [E, N, K] in float64.
    `ordered`: GPTQ's activation order, each expert's own permutation of its rows' groups."""
    groups = 1 if group == -1 else -(-k // group)
    size = k if group == -1 else group
    top = 1 << bits
    q = torch.randint(0, top, (experts, k, n), generator=g)
    zeros = torch.full((experts, groups, n), top // 2) if sym else torch.randint(0, top, (experts, groups, n), generator=g)
    scales = (torch.rand(experts, groups, n, generator=g) + 0.1).half().float() / (top // 2 * k**0.5)
    if ordered:
        rows = torch.stack([torch.randperm(k, generator=g) // size for _ in range(experts)])  # [E, K]
    else:
        rows = (torch.arange(k) // size).expand(experts, k)
    pick = torch.arange(experts)[:, None]
    w = ((q - zeros[pick, rows]).double() * scales[pick, rows].double()).transpose(1, 2)
    packed = torch.stack([pack_int4(q[e], bits) for e in range(experts)])
    return Int4Weights(packed, scales, zeros.to(torch.uint8), k, rows.to(torch.int32) if ordered else None, bits), w


def _case(t: int, k: int, experts: int, hidden: int, inter: int, group: int, sym: bool, seed: int,
          ordered: bool = False, bits: int = 4):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hidden, generator=g, dtype=torch.float64)
    w13, w13_64 = _weights(g, experts, hidden, 2 * inter, group, sym, ordered, bits)
    w2, w2_64 = _weights(g, experts, inter, hidden, group, sym, ordered, bits)
    scores = torch.rand(t, experts, generator=g) + torch.linspace(1.0, 0.0, experts)  # a hot expert, cold ones
    ids = scores.topk(k, dim=1).indices
    weights = torch.rand(t, k, generator=g, dtype=torch.float64) + 0.1
    return x, w13, w2, w13_64, w2_64, ids, weights


# (tokens, top-k, experts, hidden, intermediate, group, symmetric, bits): decode's one token, ragged
# loads, sizes off the tiles and groups (a partial last group), one group of all rows; 8-bit codes.
CASES = [(1, 2, 4, 64, 32, 32, True, 4), (7, 3, 5, 80, 48, 32, False, 4), (19, 2, 6, 96, 64, 64, False, 4),
         (5, 2, 3, 72, 40, -1, True, 4), (7, 3, 5, 80, 48, 32, False, 8), (5, 2, 3, 72, 40, -1, True, 8)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "t{}-k{}-e{}-h{}-i{}-g{}-sym{}-b{}".format(*c))
@pytest.mark.parametrize("moe", FORMULATIONS)
def test_each_formulation_is_the_int4_experts_layer(moe, case):
    x, w13, w2, w13_64, w2_64, ids, weights = _case(*case[:7], seed=sum(case[:5]), bits=case[7])
    group = case[5]
    got = moe(x.float(), w13, w2, group, ids, weights.float())
    assert got.dtype == torch.float32 and got.shape == x.shape
    want = fused_moe_reference(x, w13_64, w2_64, ids, weights)
    scale = fused_moe_reference(x.abs(), w13_64.abs(), w2_64.abs(), ids, weights, act=lambda v: v.abs())
    depth = x.shape[1] + w2_64.shape[2] + ids.shape[1]
    bound = 4 * depth * EPS32 * (scale + 1e-30)
    err = (got.double() - want).abs()
    assert (err <= bound).all(), f"max err {err.max():.3g} at bound {bound.flatten()[err.argmax()]:.3g}"


@pytest.mark.parametrize("moe", FORMULATIONS)
@pytest.mark.parametrize("t", [1, 13])
def test_activation_order(moe, t):
    """GPTQ's activation order: each expert's rows in its own permutation of the groups (group 0,
    `g_idx` per expert), so a K tile holds rows of many groups."""
    x, w13, w2, w13_64, w2_64, ids, weights = _case(t, 2, 5, 96, 64, 32, False, seed=t, ordered=True)
    got = moe(x.float(), w13, w2, 0, ids, weights.float())
    want = fused_moe_reference(x, w13_64, w2_64, ids, weights)
    scale = fused_moe_reference(x.abs(), w13_64.abs(), w2_64.abs(), ids, weights, act=lambda v: v.abs())
    depth = x.shape[1] + w2_64.shape[2] + ids.shape[1]
    assert ((got.double() - want).abs() <= 4 * depth * EPS32 * (scale + 1e-30)).all()


@pytest.mark.parametrize("moe", FORMULATIONS)
def test_bfloat16_activations(moe):
    x, w13, w2, w13_64, w2_64, ids, weights = _case(9, 2, 4, 64, 32, 32, False, seed=3)
    got = moe(x.bfloat16(), w13, w2, 32, ids, weights.bfloat16())
    assert got.dtype == torch.bfloat16
    want = fused_moe_reference(x.bfloat16().double(), w13_64, w2_64, ids, weights.bfloat16().double())
    scale = fused_moe_reference(x.abs(), w13_64.abs(), w2_64.abs(), ids, weights, act=lambda v: v.abs())
    assert ((got.double() - want).abs() <= 6 * 2.0**-8 * scale + 1e-30).all()


def _codebook_case(t: int, k: int, experts: int, hidden: int, inter: int, group: int, seed: int,
                   e8m0: bool = False, bits: int = 4):
    """bitsandbytes 4-bit experts: codes into one table of 16 uneven values (as NF4's), float32
    scales (absmax), no zeros; the meaning in float64. `e8m0`: the scales stored as MXFP4 keeps
    them, uint8 exponents e of 2^(e - 127). `bits` 8: FP8 weight-only / MXFP8A16 experts, 8-bit
    codes into the table of the 256 e4m3 values (its NaN codes left out)."""
    from batonlm.model_runner.quantization.fp8_weight_only import codebook

    g = torch.Generator().manual_seed(seed)
    table = torch.cat([torch.rand(15, generator=g) * 2 - 1, torch.zeros(1)]).sort().values
    if bits == 8:
        table = codebook("F8_E4M3") / 448

    def weights(k: int, n: int) -> tuple[Int4Weights, torch.Tensor]:
        q = torch.randint(0, 1 << bits, (experts, k, n), generator=g)
        q[q.remainder(128) == 127] = 0
        scales = (torch.rand(experts, 1 if group == -1 else -(-k // group), n, generator=g) + 0.1) / k**0.5
        stored = scales
        if e8m0:
            stored = torch.randint(120, 130, scales.shape, generator=g, dtype=torch.uint8)
            scales = torch.ldexp(torch.ones(scales.shape), stored.int() - 127)
        rows = torch.zeros(k, dtype=torch.long) if group == -1 else torch.arange(k) // group
        w = (table.double()[q] * scales.double()[:, rows]).transpose(1, 2)
        packed = torch.stack([pack_int4(q[e], bits) for e in range(experts)])
        return Int4Weights(packed, stored, None, k, None, bits, table), w

    x = torch.randn(t, hidden, generator=g, dtype=torch.float64)
    (w13, w13_64), (w2, w2_64) = weights(hidden, 2 * inter), weights(inter, hidden)
    ids = (torch.rand(t, experts, generator=g) + torch.linspace(1.0, 0.0, experts)).topk(k, dim=1).indices
    return x, w13, w2, w13_64, w2_64, ids, torch.rand(t, k, generator=g, dtype=torch.float64) + 0.1


@pytest.mark.parametrize("moe", FORMULATIONS)
@pytest.mark.parametrize("t,group,e8m0,bits", [(1, 64, False, 4), (11, 32, False, 4), (11, 32, True, 4),
                                              (1, -1, False, 8), (11, 32, True, 8)])
def test_codebook_experts(moe, t, group, e8m0, bits):
    """bitsandbytes NF4 / FP4 experts: each code's value from the table, times its block's scale;
    MXFP4's experts the same with the scales as uint8 E8M0 exponents; 8-bit codes through the e4m3
    table (FP8 weight-only per channel, MXFP8A16 with its exponents)."""
    x, w13, w2, w13_64, w2_64, ids, weights = _codebook_case(t, 2, 5, 128, 64, group, seed=t + group, e8m0=e8m0,
                                                             bits=bits)
    got = moe(x.float(), w13, w2, group, ids, weights.float())
    want = fused_moe_reference(x, w13_64, w2_64, ids, weights)
    scale = fused_moe_reference(x.abs(), w13_64.abs(), w2_64.abs(), ids, weights, act=lambda v: v.abs())
    depth = x.shape[1] + w2_64.shape[2] + ids.shape[1]
    assert ((got.double() - want).abs() <= 4 * depth * EPS32 * (scale + 1e-30)).all()
    flipped = [Int4Weights(w.qweight, w.scales, None, w.k, None, bits, w.codebook.flip(0).nan_to_num())
               for w in (w13, w2)]
    assert (moe(x.float(), *flipped, group, ids, weights.float()).double() - want).abs().max() > 0.1 * want.abs().max()


def test_a_bad_shape_is_named():
    x, w13, w2, *_, ids, weights = _case(3, 2, 4, 64, 32, 32, True, seed=1)
    bad = Int4Weights(w13.qweight, w13.scales[:, :1], w13.zeros, w13.k)
    with pytest.raises(ValueError, match="^w13_scales:"):
        fused_moe_int4_grouped(x.float(), bad, w2, 32, ids, weights.float())
    with pytest.raises(ValueError, match="^w13_g_idx:"):  # group 0 (activation order) without a g_idx
        fused_moe_int4_grouped(x.float(), w13, w2, 0, ids, weights.float())
    with pytest.raises(ValueError, match="^w13_zeros: .*neither"):  # no zeros and no codebook
        fused_moe_int4_grouped(x.float(), Int4Weights(w13.qweight, w13.scales, None, w13.k), w2, 32, ids,
                               weights.float())
    with pytest.raises(ValueError, match="^w13_codebook:"):
        fused_moe_int4_grouped(x.float(), Int4Weights(w13.qweight, w13.scales, None, w13.k, codebook=torch.zeros(8)),
                               w2, 32, ids, weights.float())


@pytest.mark.gpu
@compiled_only
@pytest.mark.parametrize("t", [1, 64])
def test_gpu_codebook_moe(t):
    """bitsandbytes NF4-style experts at Qwen3-30B-A3B's size (blocks of 64) in bfloat16."""
    x, w13, w2, w13_64, w2_64, ids, weights = _codebook_case(t, 8, 16, 2048, 768, 64, seed=t)
    cuda = [Int4Weights(w.qweight.cuda(), w.scales.cuda(), None, w.k, None, 4, w.codebook.cuda()) for w in (w13, w2)]
    got = fused_moe_int4_triton(x.bfloat16().cuda(), *cuda, 64, ids.cuda(), weights.bfloat16().cuda())
    want = fused_moe_reference(x.bfloat16().double(), w13_64, w2_64, ids, weights.bfloat16().double())
    scale = fused_moe_reference(x.abs(), w13_64.abs(), w2_64.abs(), ids, weights, act=lambda v: v.abs())
    assert ((got.double().cpu() - want).abs() <= 6 * 2.0**-8 * scale + 1e-30).all()


@pytest.mark.gpu
@compiled_only
@pytest.mark.parametrize("t,bits", [(1, 4), (64, 4), (64, 8)])
def test_gpu_int4_moe(t, bits):
    """Qwen3-30B-A3B-sized experts (hidden 2048, 768 features, groups of 128) in bfloat16."""
    x, w13, w2, w13_64, w2_64, ids, weights = _case(t, 8, 16, 2048, 768, 128, False, seed=t, bits=bits)
    cuda = [Int4Weights(w.qweight.cuda(), w.scales.cuda(), w.zeros.cuda(), w.k, None, bits) for w in (w13, w2)]
    xb, wb, idc = x.bfloat16().cuda(), weights.bfloat16().cuda(), ids.cuda()
    got = fused_moe_int4_triton(xb, *cuda, 128, idc, wb)
    want = fused_moe_reference(x.bfloat16().double(), w13_64, w2_64, ids, weights.bfloat16().double())
    scale = fused_moe_reference(x.abs(), w13_64.abs(), w2_64.abs(), ids, weights, act=lambda v: v.abs())
    assert ((got.double().cpu() - want).abs() <= 6 * 2.0**-8 * scale + 1e-30).all()


# --- NVFP4 W4A4 experts: each expert's input quantized to FP4 by its own scale ---------------------

E2M1_TABLE = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _fp4_case(t: int, k: int, experts: int, hidden: int, inter: int, seed: int, fp4_input: str,
              fp8_scales: bool = False):
    """E2M1 experts in groups of 16 with power-of-two scales, and power-of-two input scales, each
    expert's its own (one power of two or another gives the same steps, unless a group's scale
    clamps at 448: two experts' do, so their inputs saturate). Every product is then exact in float32 and so is every sum of them: an FP4
    input (an E2M1 value, 2 significant bits, times a float8 step of 4 bits times a power of two)
    times a weight (2 bits times a power of two) has at most 8 significant bits, over a range of
    exponents of about 8 more within a 16-input group and two groups (x's group scales differ by
    at most the float8 spacing of their amax range); with 5 bits of carry for <= 32 terms that is
    < 24 bits. So every formulation quantizes the same gate/up products, relu(gate) * up (one
    correctly rounded product) the same, and the down products' inputs are the same FP4 values.
    `fp8_scales`: the group scales stored as NVFP4 keeps them, float8 (1) with each expert's
    per-tensor scale (2^-3), multiplying (ModelOpt's) or dividing (compressed-tensors' 8)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hidden, generator=g)

    def weights(k: int, n: int) -> tuple[Int4Weights, torch.Tensor]:
        q = torch.randint(0, 16, (experts, k, n), generator=g)
        scales = torch.full((experts, k // 16, n), 2.0**-3)
        # each expert's t: powers of two, two so small that most of x's groups clamp at float8's 448
        scale = torch.tensor([2.0 ** -(3, 12, 5, 10)[(e + seed) % 4] for e in range(experts)])
        stored = scale if fp4_input == "modelopt" else 1 / scale  # compressed-tensors' global scale: 1 / t
        w = (E2M1_TABLE.double()[q] * 2.0**-3).transpose(1, 2)
        packed = torch.stack([pack_int4(q[e]) for e in range(experts)])
        if not fp8_scales:
            return Int4Weights(packed, scales, None, k, None, 4, E2M1_TABLE.clone(), stored, fp4_input), w
        divides = fp4_input == "compressed-tensors"
        scale_2 = torch.full((experts, n), 8.0 if divides else 2.0**-3)
        return Int4Weights(packed, torch.ones_like(scales).to(torch.float8_e4m3fn), None, k, None, 4,
                           E2M1_TABLE.clone(), stored, fp4_input, scale_2, divides), w

    w13, w13_64 = weights(hidden, 2 * inter)
    w2, w2_64 = weights(inter, hidden)
    ids = (torch.rand(t, experts, generator=g) + torch.linspace(1.0, 0.0, experts)).topk(k, dim=1).indices
    return x, w13, w2, w13_64, w2_64, ids, torch.rand(t, k, generator=g) + 0.1


@pytest.mark.parametrize("fp4_input", ["compressed-tensors", "modelopt"])
@pytest.mark.parametrize("t,fp8_scales", [(1, False), (9, False), (9, True)])
@pytest.mark.parametrize("moe", FORMULATIONS)
def test_fp4_activations_are_quantized_by_each_experts_scale(moe, t, fp8_scales, fp4_input):
    """Each routed row through its expert: FP4(x, its gate/up scale) @ W13^T, relu(gate) * up,
    FP4(that, its down scale) @ W2^T, weighted and summed; the float64 loop over pairs computes the
    same FP4 values (the sums are exact, `_fp4_case`), so only the routing sum rounds."""
    from batonlm.kernels.fp4 import FP4_INPUTS

    x, w13, w2, w13_64, w2_64, ids, weights = _fp4_case(t, 2, 4, 32, 16, seed=t, fp4_input=fp4_input,
                                                        fp8_scales=fp8_scales)
    got = moe(x, w13, w2, 16, ids, weights, act=torch.relu)
    quantize = FP4_INPUTS[fp4_input]
    assert w13.input_scale is not None and w2.input_scale is not None
    want, magnitude = torch.zeros(t, x.shape[1], dtype=torch.float64), torch.zeros(t, x.shape[1], dtype=torch.float64)
    for i in range(t):
        for j in range(ids.shape[1]):
            e = int(ids[i, j])
            h = quantize(x[i : i + 1], w13.input_scale[e]).double() @ w13_64[e].T
            gate, up = h.chunk(2, dim=-1)
            a = (gate.relu() * up).float()  # the formulations' float32 product: correctly rounded
            y = float(weights[i, j]) * (quantize(a, w2.input_scale[e]).double() @ w2_64[e].T)[0]
            want[i] += y
            magnitude[i] += y.abs()
    # the pair outputs are exact (few-bit operands); each weighted one and the running sum round
    assert ((got.double() - want).abs() <= 2 * ids.shape[1] * EPS32 * magnitude + 1e-30).all()
    # each expert's own scale: the first expert's for every row gives other outputs
    one = dataclasses.replace(w13, input_scale=w13.input_scale[:1].expand(4).clone())
    assert not torch.equal(moe(x, one, w2, 16, ids, weights, act=torch.relu), got)


# --- MXFP8 experts: every routed row's input quantized per 32 with a power-of-two scale ----------


def _mx_case(t: int, k: int, experts: int, hidden: int, inter: int, seed: int, tool: str):
    """E2M1 experts (2 significant bits times 2^-3) and inputs of 9 significant bits within 4
    binades, so MXFP8 rounds them (to 4 bits) and their gate/up products and sums are exact in
    float32 (4 + 2 bits over 4 binades and 5 bits of carry): every formulation quantizes the same
    values for the down product, whose sums round (float32's bound)."""
    g = torch.Generator().manual_seed(seed)
    sign = torch.randint(0, 2, (t, hidden), generator=g) * 2 - 1
    x = sign * (1 + torch.randint(0, 256, (t, hidden), generator=g) / 256) * 2.0 ** torch.randint(-2, 2, (t, hidden),
                                                                                                    generator=g)

    def weights(k: int, n: int) -> tuple[Int4Weights, torch.Tensor]:
        q = torch.randint(0, 16, (experts, k, n), generator=g)
        w = (E2M1_TABLE.double()[q] * 2.0**-3).transpose(1, 2)
        packed = torch.stack([pack_int4(q[e]) for e in range(experts)])
        return Int4Weights(packed, torch.full((experts, 1, n), 2.0**-3), None, k, None, 4, E2M1_TABLE.clone(),
                           input_quant=f"mxfp8-{tool}"), w

    w13, w13_64 = weights(hidden, 2 * inter)
    w2, w2_64 = weights(inter, hidden)
    ids = (torch.rand(t, experts, generator=g) + torch.linspace(1.0, 0.0, experts)).topk(k, dim=1).indices
    return x.float(), w13, w2, w13_64, w2_64, ids, torch.rand(t, k, generator=g) + 0.1


@pytest.mark.parametrize("tool", ["compressed-tensors", "modelopt"])
@pytest.mark.parametrize("t", [1, 9])
@pytest.mark.parametrize("moe", FORMULATIONS)
def test_mxfp8_inputs_are_quantized_before_each_product(moe, t, tool):
    """Each routed row: MXFP8(x) @ W13^T, relu(gate) * up, MXFP8(that) @ W2^T, weighted and
    summed, against the float64 loop over pairs with the same quantization (the gate/up sums are
    exact, `_mx_case`); without the quantization the outputs differ."""
    from batonlm.kernels.mxfp8 import MX_INPUTS

    x, w13, w2, w13_64, w2_64, ids, weights = _mx_case(t, 2, 4, 32, 16, seed=t, tool=tool)
    got = moe(x, w13, w2, -1, ids, weights, act=torch.relu)
    quantize = MX_INPUTS[tool]
    want, magnitude = torch.zeros(t, x.shape[1], dtype=torch.float64), torch.zeros(t, x.shape[1], dtype=torch.float64)
    for i in range(t):
        for j in range(ids.shape[1]):
            e = int(ids[i, j])
            h = quantize(x[i : i + 1], use_triton=False).double() @ w13_64[e].T
            gate, up = h.chunk(2, dim=-1)
            a = (gate.relu() * up).float()  # the formulations' float32 product: correctly rounded
            y = float(weights[i, j]) * (quantize(a, use_triton=False).double() @ w2_64[e].T)[0]
            want[i] += y
            magnitude[i] += y.abs()
    assert ((got.double() - want).abs() <= (w2_64.shape[2] + 2 * ids.shape[1]) * EPS32 * magnitude + 1e-30).all()
    plain = [dataclasses.replace(w, input_quant="") for w in (w13, w2)]
    assert (moe(x, *plain, -1, ids, weights, act=torch.relu) - got).abs().max() > 1e-3 * got.abs().max()


@pytest.mark.gpu
@compiled_only
@pytest.mark.parametrize("tool", ["compressed-tensors", "modelopt"])
def test_gpu_mxfp8_experts(tool):
    """Compiled: the Triton formulation (its MXFP8 inputs by the Triton quantizer) against the CPU
    reference formulation, to the down sums' float32 bound."""
    x, w13, w2, w13_64, w2_64, ids, weights = _mx_case(33, 2, 4, 256, 128, seed=5, tool=tool)
    want = fused_moe_int4_grouped(x, w13, w2, -1, ids, weights, act=torch.relu)
    cuda = [dataclasses.replace(w, qweight=w.qweight.cuda(), scales=w.scales.cuda(), codebook=w.codebook.cuda())
            for w in (w13, w2)]
    got = fused_moe_int4_triton(x.cuda(), *cuda, -1, ids.cuda(), weights.cuda(), act=torch.relu).cpu()
    magnitude = fused_moe_reference(x.double().abs(), w13_64.abs(), w2_64.abs(), ids, weights.double(),
                                    act=lambda v: v.abs())
    assert ((got.double() - want.double()).abs() <= 4 * (256 + 128) * EPS32 * magnitude + 1e-30).all()
