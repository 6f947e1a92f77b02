"""MoE experts kept in FP8 blocks (`Fp8Experts`: DeepSeek-V3's and Qwen3-MoE FP8's routed experts)
instead of dequantized: filled with each expert's own codes and scales (this rank's whole blocks),
and computing what the kernels of batonlm/kernels/moe_fp8.py compute (checked against float64
in tests/kernels/test_moe_fp8_kernels.py) on the checkpoint's own tensors.

Bound between ranks and paths: the gated intermediate is quantized to FP8 again, and computed in
another order it may land one FP8 step away (2^-3 of it at most), through the down projection:
2^-3 sum_k w_k (|g_k| @ |W2_k|^T), as in the kernel tests.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from quant_formats import LINEARS, write_fp8_block_checkpoint
from quant_w8a8 import write_w8a8_checkpoint
from safetensors.torch import load_file

from batonlm.distributed.group import TPGroup
from batonlm.kernels.moe_fp8 import (
    float_operand,
    fused_moe_fp8_dense,
    fused_moe_fp8_gathered,
    fused_moe_fp8_grouped,
)
from batonlm.model_runner.model_config import ModelConfig
from batonlm.model_runner.model_loader import load_model, tp_layout
from batonlm.model_runner.moe import Fp8Experts, FusedExperts, SparseMoE
from batonlm.model_runner.quantization.config import QuantizationError
from batonlm.model_runner.weight_loader import checkpoint_name
from batonlm.model_runner.weight_size import held_tensors

BLOCK = (16, 16)
# family -> the checkpoint's expert projection names (gate, up, down)
FAMILIES = {"deepseek_v3": ("gate_proj", "up_proj", "down_proj"), "qwen3_moe": ("gate_proj", "up_proj", "down_proj"),
            "mixtral": ("w1", "w3", "w2")}


@pytest.fixture(scope="module")
def fp8_moe(tiny_models, tmp_path_factory) -> dict[str, Path]:
    """family -> its FP8-block checkpoint; "<family>-channel" -> its FP8_DYNAMIC one (per channel)."""
    out = {}
    for family, names in FAMILIES.items():
        path = tmp_path_factory.mktemp("fp8moe") / family
        write_fp8_block_checkpoint(tiny_models[family], path, block=BLOCK, linears=LINEARS + names)
        out[family] = path
        channel = tmp_path_factory.mktemp("fp8moe") / f"{family}-channel"
        write_w8a8_checkpoint(tiny_models[family], channel, torch.float32, LINEARS + names, kind="float")
        out[f"{family}-channel"] = channel
    return out


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def _moe_layers(model) -> list[tuple[str, SparseMoE]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, SparseMoE)]


def _stacked(tensors: dict[str, torch.Tensor], prefix: str, names: tuple[str, ...], experts: int, block: bool):
    """An MoE layer's experts straight from the checkpoint's tensors, stacked as Fp8Experts holds
    them (block scales `weight_scale_inv`, or channel scales `weight_scale` [N, 1] as [N])."""
    gate, up, down = names

    def get(e: int, n: str, leaf: str) -> torch.Tensor:
        return tensors[f"{prefix}.{e}.{n}.{leaf}"]

    def scale(e: int, n: str) -> torch.Tensor:
        return get(e, n, "weight_scale_inv") if block else get(e, n, "weight_scale").float().reshape(-1)

    w13_q = torch.stack([torch.cat([get(e, gate, "weight"), get(e, up, "weight")]) for e in range(experts)])
    w13_s = torch.stack([torch.cat([scale(e, gate), scale(e, up)]) for e in range(experts)])
    w2_q = torch.stack([get(e, down, "weight") for e in range(experts)])
    w2_s = torch.stack([scale(e, down) for e in range(experts)])
    return w13_q, w13_s, w2_q, w2_s


@pytest.mark.parametrize("block", [True, False], ids=["blocks", "channels"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_fp8_experts_hold_and_compute_the_checkpoints_experts(family: str, block: bool, fp8_moe) -> None:
    path = fp8_moe[family if block else f"{family}-channel"]
    cfg = ModelConfig.from_hf(path)
    model = load_model(cfg, torch.float32, "cpu")[0]  # W8A8: kept FP8 on the CPU too
    layers = _moe_layers(model)
    assert layers and all(isinstance(m.experts, Fp8Experts) for _, m in layers)
    assert all(m.experts.block == (BLOCK if block else None) for _, m in layers)
    tensors = load_file(str(path / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    for name, moe in layers:
        experts = moe.experts
        assert isinstance(experts, Fp8Experts)
        prefix = checkpoint_name(model, name + ".experts")
        want = _stacked(tensors, prefix, FAMILIES[family], experts.w13_q.shape[0], block)
        got = (experts.w13_q, experts.w13_scale, experts.w2_q, experts.w2_scale)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.dtype != torch.float32 else a,
                                                      b.view(torch.uint8) if b.dtype != torch.float32 else b)
        # On the CPU the layer multiplies the references' float32 operands, kept from load (not
        # counted as weights), and computes what the formulation does on the codes, bit for bit.
        assert experts.w13_f is not None and experts.w2_f is not None
        assert torch.equal(experts.w2_f, float_operand(experts.w2_q, experts.w2_scale, experts.block))
        assert not any(t is experts.w13_f for t in held_tensors(model))
        x = torch.randn(9, cfg.hidden_size, generator=g)
        ids, weights = moe.route(x)
        assert torch.equal(experts(x, ids, weights, moe.act),
                           fused_moe_fp8_grouped(x, *want, BLOCK if block else None, ids, weights, moe.act))


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_moe-channel"])
def test_a_compiled_step_takes_the_dense_or_gathered_formulation(name: str, fp8_moe) -> None:
    """Traced (as the CPU's compiled decode step traces the model) the layer runs the dense
    formulation, whose shapes the batch size alone fixes, or with fewer routed copies than experts
    the gathered one; eager, the grouped one."""
    model = load_model(ModelConfig.from_hf(fp8_moe[name]), torch.float32, "cpu")[0]
    _, moe = _moe_layers(model)[0]
    experts = moe.experts
    assert isinstance(experts, Fp8Experts)
    for tokens, traced_as in ((5, fused_moe_fp8_dense), (1, fused_moe_fp8_gathered)):  # 8 experts, top 3
        torch._dynamo.reset()
        x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(1))
        ids, weights = moe.route(x)
        args = (experts.w13_q, experts.w13_scale, experts.w2_q, experts.w2_scale, experts.block, ids, weights, moe.act)
        traced = torch.compile(lambda x, ids=ids, weights=weights: experts(x, ids, weights, moe.act),
                               backend="eager", fullgraph=True)(x)
        assert torch.equal(traced, traced_as(x, *args))
        assert torch.equal(experts(x, ids, weights, moe.act), fused_moe_fp8_grouped(x, *args))


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v3-channel"])
def test_two_ranks_experts_sum_to_one_ranks(name: str, fp8_moe) -> None:
    """Each rank holds every expert's rows of gate/up and columns of down, in whole blocks (its
    activation groups are whole groups of the one-rank layer) or with their channel scales (its
    per-token scale is its slice's): the ranks' outputs sum to the one-rank layer's."""
    cfg = ModelConfig.from_hf(fp8_moe[name])
    full = load_model(cfg, torch.float32, "cpu")[0]
    ranks = [load_model(cfg, torch.float32, "cpu", TPGroup(r, 2), tp_layout(cfg, r, 2))[0] for r in range(2)]
    x = torch.randn(6, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    (name, moe), = _moe_layers(full)
    experts = moe.experts
    assert isinstance(experts, Fp8Experts)
    ids, weights = moe.route(x)
    want = experts(x, ids, weights, moe.act)
    parts = []
    for m in ranks:
        part = m.get_submodule(name).experts
        assert isinstance(part, Fp8Experts) and part.w13_q.shape[1] == experts.w13_q.shape[1] // 2
        parts.append(part(x, ids, weights, moe.act))
    mag = _magnitude(x, experts, ids, weights, moe.act)
    assert ((sum(parts) - want).abs() <= 2.0**-3 * mag + 1e-5 * want.abs().max()).all()


def _magnitude(x, experts: Fp8Experts, ids, weights, act) -> torch.Tensor:
    """sum_k w_k (|g_k| @ |W2_k|^T) per token, in float64 (twice |g|: its FP8 rounding within)."""
    from batonlm.kernels.quant import dequantize_fp8_block

    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e = int(ids[t, slot])
            w13, w2 = (dequantize_fp8_block(q[e], s[e], experts.block, torch.float64) if experts.block
                       else q[e].double() * s[e].double()[:, None]
                       for q, s in ((experts.w13_q, experts.w13_scale), (experts.w2_q, experts.w2_scale)))
            gate, up = (x[t].double() @ w13.T).chunk(2)
            out[t] += float(weights[t, slot]) * (2 * (act(gate) * up).abs() @ w2.abs().T)
    return out


def test_a_slice_that_would_split_an_experts_blocks_is_refused(tiny_models, tmp_path) -> None:
    """Mixtral's experts of 48 features in blocks of 16: two ranks' 24 would split one."""
    path = tmp_path / "mixtral-experts-fp8"
    write_fp8_block_checkpoint(tiny_models["mixtral"], path, block=BLOCK, linears=FAMILIES["mixtral"])
    cfg = ModelConfig.from_hf(path)
    with pytest.raises(QuantizationError, match=r"experts: .*\[0, 24\).*16x16 blocks.*--tp"):
        load_model(cfg, torch.float32, "cpu", TPGroup(0, 2), tp_layout(cfg, 0, 2))


def test_online_fp8_keeps_the_experts_fp8_per_channel(tiny_models) -> None:
    """`--quantization fp8` on a float MoE, kept resident (a GPU with FP8): each expert's codes
    and channel scales are its float weight's rounding (`fp8_per_channel`)."""
    from batonlm.model_runner.quantization.dequantized import fp8_per_channel

    src = Path(tiny_models["mixtral"])
    model = load_model(ModelConfig.from_hf(src, quantization="fp8"), torch.float32, "cpu", resident=True)[0]
    tensors = load_file(str(next(src.glob("*.safetensors"))))
    (name, moe), *_ = _moe_layers(model)
    experts = moe.experts
    assert isinstance(experts, Fp8Experts) and experts.block is None
    prefix = checkpoint_name(model, name + ".experts")
    for e in range(experts.w13_q.shape[0]):
        w1, s1 = fp8_per_channel(tensors[f"{prefix}.{e}.w1.weight"])
        w3, s3 = fp8_per_channel(tensors[f"{prefix}.{e}.w3.weight"])
        w2, s2 = fp8_per_channel(tensors[f"{prefix}.{e}.w2.weight"])
        assert torch.equal(experts.w13_q[e].view(torch.uint8), torch.cat([w1, w3]).view(torch.uint8))
        assert torch.equal(experts.w13_scale[e], torch.cat([s1, s3])) and torch.equal(experts.w2_scale[e], s2)
        assert torch.equal(experts.w2_q[e].view(torch.uint8), w2.view(torch.uint8))


def test_weight_only_loading_still_dequantizes_the_experts(fp8_moe) -> None:
    model = load_model(ModelConfig.from_hf(fp8_moe["mixtral"]), torch.float32, "cpu", resident=False)[0]
    assert all(isinstance(m.experts, FusedExperts) for _, m in _moe_layers(model))


def test_gpu_sizing_counts_the_experts_at_a_byte_per_weight(fp8_moe) -> None:
    from batonlm.model_runner.weight_size import held_tensors, weight_bytes

    cfg = ModelConfig.from_hf(fp8_moe["qwen3_moe"])
    model = load_model(cfg, torch.bfloat16, "cpu", resident=True)[0]
    held = sum(t.numel() * t.element_size() for t in held_tensors(model))
    assert weight_bytes(cfg, torch.bfloat16, device="cpu", resident=True) == held
    experts = [m.experts for _, m in _moe_layers(model)]
    fp8 = sum(t.numel() for e in experts for t in (e.w13_q, e.w2_q))
    assert weight_bytes(cfg, torch.bfloat16, device="cpu", resident=False) - held >= fp8 - sum(
        4 * (e.w13_scale.numel() + e.w2_scale.numel()) for e in experts)


# --- int4 experts (GPTQ, AWQ): weight-only, kept int4 where the projections are (CUDA; here
# resident=True). Their weights dequantize exactly to float32, so with float32 activations the
# layer is the dequantized float experts' to the bit.

@pytest.fixture(scope="module")
def int4_moe(tiny_models, tmp_path_factory) -> dict[str, Path]:
    from helpers import build_tiny_model
    from quant_formats import write_awq_checkpoint, write_gptq_checkpoint

    root = tmp_path_factory.mktemp("int4moe")
    build_tiny_model("mixtral", root / "mixtral", intermediate_size=96)  # experts of three groups of 32
    write_gptq_checkpoint(root / "mixtral", root / "mixtral-gptq", group_size=32, sym=False,
                          linears=LINEARS + FAMILIES["mixtral"])
    # Two groups of 32 per expert (and per rank of two, as the dense first layer's 128 features).
    build_tiny_model("qwen3_moe", root / "qwen3_moe", moe_intermediate_size=64, intermediate_size=128)
    write_awq_checkpoint(root / "qwen3_moe", root / "qwen3_moe-awq", group_size=32)
    return {"mixtral": root / "mixtral-gptq", "qwen3_moe": root / "qwen3_moe-awq"}


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_int4_experts_are_the_dequantized_experts(family: str, int4_moe) -> None:
    from batonlm.kernels.moe import fused_moe_grouped
    from batonlm.kernels.moe_int4 import Int4Weights, fused_moe_int4_dense
    from batonlm.model_runner.moe import Int4Experts

    cfg = ModelConfig.from_hf(int4_moe[family])
    model = load_model(cfg, torch.float32, "cpu", resident=True)[0]
    plain = load_model(cfg, torch.float32, "cpu", resident=False)[0]
    layers = _moe_layers(model)
    assert layers and all(isinstance(m.experts, Int4Experts) and m.experts.group == 32 for _, m in layers)
    g = torch.Generator().manual_seed(3)
    for name, moe in layers:
        floats = plain.get_submodule(name).experts
        assert isinstance(floats, FusedExperts)
        x = torch.randn(11, cfg.hidden_size, generator=g)
        ids, weights = moe.route(x)
        assert torch.equal(moe.experts(x, ids, weights, moe.act),
                           fused_moe_grouped(x, floats.w13, floats.w2, ids, weights, moe.act))
        traced = torch.compile(lambda x, moe=moe, ids=ids, weights=weights: moe.experts(x, ids, weights, moe.act),
                               backend="eager", fullgraph=True)(x)
        e = moe.experts
        w13 = Int4Weights(e.w13_qweight, e.w13_scales, e.w13_zeros, e.hidden)
        w2 = Int4Weights(e.w2_qweight, e.w2_scales, e.w2_zeros, e.count)
        assert torch.equal(traced, fused_moe_int4_dense(x, w13, w2, e.group, ids, weights, moe.act))


def _within_float32(got: torch.Tensor, want: torch.Tensor, floats64, x: torch.Tensor, ids: torch.Tensor,
                    weights: torch.Tensor) -> bool:
    """float32 sums in another order: 4 * depth * eps of the magnitudes |x| |W13| |act| |W2| (the
    float experts' bound), from the layer's float64 experts."""
    from batonlm.kernels.moe import fused_moe_reference

    mag = fused_moe_reference(x.double().abs(), floats64.w13.abs(), floats64.w2.abs(), ids, weights.double(),
                              act=lambda v: v.abs())
    depth = x.shape[1] + floats64.w2.shape[2] + ids.shape[1]
    return bool(((got.double() - want.double()).abs() <= 4 * depth * torch.finfo(torch.float32).eps * mag).all())


def _packed_experts_are_the_dequantized_experts(cfg: ModelConfig, model, x: torch.Tensor) -> None:
    """Each MoE layer's packed experts against the same checkpoint's experts dequantized: with
    float32 activations the same rounded weights, so bit for bit eager; traced (the dense
    formulation) within the float32 bound."""
    from batonlm.kernels.moe import fused_moe_grouped

    plain = load_model(cfg, torch.float32, "cpu", resident=False)[0]
    floats64 = load_model(cfg, torch.float64, "cpu", resident=False)[0]
    for name, moe in _moe_layers(model):
        floats = plain.get_submodule(name).experts
        assert isinstance(floats, FusedExperts)
        ids, weights = moe.route(x)
        want = fused_moe_grouped(x, floats.w13, floats.w2, ids, weights, moe.act)
        assert torch.equal(moe.experts(x, ids, weights, moe.act), want)
        traced = torch.compile(lambda x, moe=moe, ids=ids, weights=weights: moe.experts(x, ids, weights, moe.act),
                               backend="eager", fullgraph=True)(x)
        assert _within_float32(traced, want, floats64.get_submodule(name).experts, x, ids, weights)


def test_8_bit_experts_are_the_dequantized_experts(tmp_path) -> None:
    """GPTQ 8-bit experts (4 codes per word) stay packed like int4 ones: with float32
    activations the dequantized experts' outputs, bit for bit eager, traced to float32's bound."""
    from helpers import build_tiny_model
    from quant_formats import write_gptq_checkpoint

    from batonlm.model_runner.moe import Int4Experts

    build_tiny_model("qwen3_moe", tmp_path / "qwen3_moe", moe_intermediate_size=64, intermediate_size=128)
    path = tmp_path / "qwen3_moe-gptq8"  # groups of 32: two per expert's down projection
    write_gptq_checkpoint(tmp_path / "qwen3_moe", path, bits=8, group_size=32, sym=False,
                          linears=LINEARS + FAMILIES["qwen3_moe"])
    cfg = ModelConfig.from_hf(path)
    model = load_model(cfg, torch.float32, "cpu", resident=True)[0]
    layers = _moe_layers(model)
    assert layers and all(isinstance(m.experts, Int4Experts) and m.experts.bits == 8 for _, m in layers)
    _packed_experts_are_the_dequantized_experts(cfg, model, torch.randn(7, cfg.hidden_size,
                                                                        generator=torch.Generator().manual_seed(9)))


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_bitsandbytes_4_bit_experts_are_the_dequantized_experts(family: str, tiny_models, tmp_path) -> None:
    """NF4 experts (older transformers saved a Mixtral's experts as linear layers, which
    bitsandbytes quantized) stay packed with the table where int4 experts do: with float32
    activations the dequantized experts' outputs bit for bit eager, traced to float32's bound;
    two ranks (one whole block of 32 each of a Qwen3-MoE expert's 64 features) sum to one."""
    from helpers import build_tiny_model
    from quant_bnb import write_bnb4_checkpoint

    from batonlm.model_runner.moe import Int4Experts

    src = tmp_path / family
    build_tiny_model(family, src, **({"moe_intermediate_size": 64, "intermediate_size": 128}
                                     if family == "qwen3_moe" else {"intermediate_size": 96}))
    path = tmp_path / f"{family}-nf4"
    write_bnb4_checkpoint(src, path, blocksize=32, linears=LINEARS + FAMILIES[family])
    cfg = ModelConfig.from_hf(path)
    model = load_model(cfg, torch.float32, "cpu", resident=True)[0]
    layers = _moe_layers(model)
    assert layers and all(isinstance(m.experts, Int4Experts) and m.experts.codebook is not None
                          and m.experts.w13_zeros is None and m.experts.group == 32 for _, m in layers)
    x = torch.randn(9, cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    _packed_experts_are_the_dequantized_experts(cfg, model, x)
    if family == "qwen3_moe":
        _two_ranks_sum_to_one(cfg, layers[0], x)


def _two_ranks_sum_to_one(cfg: ModelConfig, layer: tuple[str, SparseMoE], x: torch.Tensor) -> None:
    """The MoE layer's experts on two ranks (each its gate/up columns, its down rows in whole
    groups) sum to the one-rank layer's outputs, float32 apart."""
    ranks = [load_model(cfg, torch.float32, "cpu", TPGroup(r, 2), tp_layout(cfg, r, 2), resident=True)[0]
             for r in range(2)]
    name, moe = layer
    ids, weights = moe.route(x)
    got = sum(m.get_submodule(name).experts(x, ids, weights, moe.act) for m in ranks)
    floats64 = load_model(cfg, torch.float64, "cpu", resident=False)[0].get_submodule(name).experts
    assert _within_float32(got, moe.experts(x, ids, weights, moe.act), floats64, x, ids, weights)


@pytest.mark.parametrize("fmt, group", [("nvfp4", 16), ("modelopt-nvfp4", 16), ("mxfp4", 32)])
def test_fp4_experts_are_the_dequantized_experts(tiny_models, tmp_path, fmt, group) -> None:
    """NVFP4A16 experts (FP4 codes, FP8 scales per 16 inputs, a global scale; compressed-tensors'
    layout or ModelOpt's) and MXFP4A16 ones (E8M0 exponents per 32) stay packed with the E2M1 table
    in their groups: the dequantized experts' outputs bit for bit eager, traced to float32's bound."""
    from helpers import build_tiny_model
    from quant_nvfp4 import write_modelopt_nvfp4_checkpoint, write_mxfp4_checkpoint, write_nvfp4_checkpoint

    from batonlm.model_runner.moe import Int4Experts

    build_tiny_model("qwen3_moe", tmp_path / "qwen3_moe", moe_intermediate_size=64, intermediate_size=128)
    path = tmp_path / f"qwen3_moe-{fmt}"
    write = {"nvfp4": write_nvfp4_checkpoint, "modelopt-nvfp4": write_modelopt_nvfp4_checkpoint,
             "mxfp4": write_mxfp4_checkpoint}[fmt]
    write(tmp_path / "qwen3_moe", path, linears=LINEARS + FAMILIES["qwen3_moe"])
    cfg = ModelConfig.from_hf(path)
    model = load_model(cfg, torch.float32, "cpu", resident=True)[0]
    layers = _moe_layers(model)
    assert layers and all(isinstance(m.experts, Int4Experts) and m.experts.codebook is not None
                          and m.experts.group == group for _, m in layers)
    # the group scales as the format stores them (1 byte a group), NVFP4's per-tensor scale beside
    stored = torch.uint8 if fmt == "mxfp4" else torch.float8_e4m3fn  # (MXFP4: its E8M0 exponents)
    assert all(m.experts.w13_scales.dtype == stored and (m.experts.w2_scale_2 is not None) == (fmt != "mxfp4")
               for _, m in layers)
    x = torch.randn(8, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    _packed_experts_are_the_dequantized_experts(cfg, model, x)
    _two_ranks_sum_to_one(cfg, layers[0], x)  # (gate and up columns each with their per-tensor scales)


@pytest.mark.parametrize("fmt", ["fp8-weight-only", "mxfp8a16", "fp8-weight-only-experts"])
def test_8_bit_fp8_experts_are_the_dequantized_experts(tiny_models, tmp_path, fmt) -> None:
    """FP8 weight-only experts (compressed-tensors FP8 per channel without input activations;
    also as one config group, "re:.*mlp.*", beside an FP8_DYNAMIC attention group) and
    MXFP8A16 ones (E8M0 exponents per 32, kept as bytes) stay packed as 8-bit codes through the
    e4m3 table: the dequantized experts' outputs bit for bit eager, traced to float32's bound;
    two ranks sum to one."""
    import json

    from helpers import build_tiny_model
    from quant_mxfp8 import write_mxfp8_checkpoint

    from batonlm.model_runner.moe import Int4Experts

    build_tiny_model("qwen3_moe", tmp_path / "qwen3_moe", moe_intermediate_size=64, intermediate_size=128)
    path = tmp_path / f"qwen3_moe-{fmt}"
    linears = LINEARS + FAMILIES["qwen3_moe"]
    if fmt == "mxfp8a16":
        write_mxfp8_checkpoint(tmp_path / "qwen3_moe", path, activations=False, linears=linears)
    else:
        write_w8a8_checkpoint(tmp_path / "qwen3_moe", path, kind="float", linears=linears)
        config = json.loads((path / "config.json").read_text())
        groups = config["quantization_config"]["config_groups"]
        if fmt == "fp8-weight-only-experts":
            groups["group_1"] = dict(groups["group_0"], input_activations=None, targets=["re:.*mlp.*"])
            groups["group_0"]["targets"] = ["re:.*self_attn.*"]
        else:
            groups["group_0"]["input_activations"] = None
        (path / "config.json").write_text(json.dumps(config))
    cfg = ModelConfig.from_hf(path)
    model = load_model(cfg, torch.float32, "cpu", resident=True)[0]
    layers = _moe_layers(model)
    assert layers and all(isinstance(m.experts, Int4Experts) and m.experts.bits == 8 and m.experts.codebook is not None
                          and m.experts.group == (32 if fmt == "mxfp8a16" else -1) for _, m in layers)
    assert all(m.experts.w13_scales.dtype == (torch.uint8 if fmt == "mxfp8a16" else torch.float32) for _, m in layers)
    if fmt == "fp8-weight-only-experts":  # the attention's inputs stay quantized: W8A8
        assert all(type(m).__name__ == "Fp8Linear" for n, m in model.named_modules() if n.endswith("qkv_proj"))
    x = torch.randn(8, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    _packed_experts_are_the_dequantized_experts(cfg, model, x)
    _two_ranks_sum_to_one(cfg, layers[0], x)


def test_two_ranks_int4_experts_sum_to_one_ranks(int4_moe) -> None:
    """Qwen3-MoE's experts of 64 features in groups of 32: each of two ranks holds one whole group
    of every expert's down rows; their outputs sum to the one-rank layer's (float32 apart)."""
    cfg = ModelConfig.from_hf(int4_moe["qwen3_moe"])
    full = load_model(cfg, torch.float32, "cpu", resident=True)[0]
    ranks = [load_model(cfg, torch.float32, "cpu", TPGroup(r, 2), tp_layout(cfg, r, 2), resident=True)[0]
             for r in range(2)]
    name, moe = _moe_layers(full)[0]
    x = torch.randn(6, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    ids, weights = moe.route(x)
    want = moe.experts(x, ids, weights, moe.act)
    got = sum(m.get_submodule(name).experts(x, ids, weights, moe.act) for m in ranks)
    floats = load_model(cfg, torch.float64, "cpu", resident=False)[0].get_submodule(name).experts
    assert isinstance(floats, FusedExperts)
    assert _within_float32(got, want, floats, x, ids, weights)


def test_an_int4_slice_that_would_split_a_group_is_refused(int4_moe) -> None:
    cfg = ModelConfig.from_hf(int4_moe["mixtral"])  # experts of 96 features in groups of 32: 48 per rank
    with pytest.raises(QuantizationError, match=r"experts: .*\[0, 48\).*groups of 32"):
        load_model(cfg, torch.float32, "cpu", TPGroup(0, 2), tp_layout(cfg, 0, 2), resident=True)


# --- W8A8 int8 experts (llm-compressor's W8A8 on a MoE): kept int8 on every device, as W8A8 is.

@pytest.fixture(scope="module")
def int8_moe(tiny_models, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("int8moe")
    out = {}
    for family in ("qwen3_moe", "mixtral"):
        write_w8a8_checkpoint(tiny_models[family], root / family, torch.float32, LINEARS + FAMILIES[family])
        out[family] = root / family
    return out


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_int8_experts_hold_and_compute_the_checkpoints_experts(family: str, int8_moe) -> None:
    from batonlm.kernels.moe_int8 import fused_moe_int8_dense, fused_moe_int8_grouped
    from batonlm.model_runner.moe import Int8Experts

    cfg = ModelConfig.from_hf(int8_moe[family])
    model = load_model(cfg, torch.float32, "cpu")[0]  # W8A8: kept int8 on the CPU too
    layers = _moe_layers(model)
    assert layers and all(isinstance(m.experts, Int8Experts) for _, m in layers)
    tensors = load_file(str(int8_moe[family] / "model.safetensors"))
    g = torch.Generator().manual_seed(5)
    for name, moe in layers:
        experts = moe.experts
        want = _stacked(tensors, checkpoint_name(model, name + ".experts"), FAMILIES[family],
                        experts.w13_q.shape[0], block=False)
        for a, b in zip((experts.w13_q, experts.w13_scale, experts.w2_q, experts.w2_scale), want):
            assert a.dtype == b.dtype and torch.equal(a, b)
        x = torch.randn(9, cfg.hidden_size, generator=g)
        ids, weights = moe.route(x)
        reference = fused_moe_int8_grouped(x, *want, ids, weights, moe.act)
        assert torch.equal(experts(x, ids, weights, moe.act), reference)
        traced = torch.compile(lambda x, moe=moe, ids=ids, weights=weights: moe.experts(x, ids, weights, moe.act),
                               backend="eager", fullgraph=True)(x)
        assert torch.equal(traced, fused_moe_int8_dense(x, *want, ids, weights, moe.act))


def test_experts_with_asymmetric_int8_activations_stay_packed_and_quantize_their_inputs(tiny_models, tmp_path) -> None:
    """W8A8 int8 with zero points on its activations: the projections keep them (`Int8Linear`,
    the weight rows' sums); the experts (no int8 kernel takes zero points) stay packed as 8-bit
    codes, `Int4Experts` quantizing both inputs to int8 with a zero point per row and back
    (kernels/input_quant.py), their weights the checkpoint's codes times scales; the input
    quantization changes the outputs (it ran dequantized on float inputs before)."""
    from batonlm.model_runner.quantization.linear import Int8Linear

    path = tmp_path / "asym"
    deq = write_w8a8_checkpoint(tiny_models["qwen3_moe"], path, torch.float32, LINEARS + FAMILIES["qwen3_moe"],
                                asym_activations=True)
    cfg = ModelConfig.from_hf(path)
    model = load_model(cfg, torch.float32, "cpu")[0]
    projections = [m for m in model.modules() if isinstance(m, Int8Linear)]
    assert projections and all(m.weight_sum is not None for m in projections)
    _packed_experts_quantize_their_inputs(model, cfg, deq, "int8-asym")


def _packed_experts_quantize_their_inputs(model, cfg: ModelConfig, deq: dict[str, torch.Tensor], input_quant: str) -> None:
    """Every MoE layer's experts are 8-bit `Int4Experts` quantizing both inputs by `input_quant`:
    their down weights the checkpoint's dequantized ones, their outputs the grouped formulation's
    (kernels/moe_int4.py's formulations are tested against it), which the input quantization
    changes."""
    import dataclasses

    from batonlm.kernels.moe_int4 import dense_weights, fused_moe_int4_grouped
    from batonlm.model_runner.moe import Int4Experts

    layers = _moe_layers(model)
    assert layers
    x = torch.randn(8, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    for name, moe in layers:
        experts = moe.experts
        assert isinstance(experts, Int4Experts) and experts.bits == 8 and experts.input_quant == input_quant
        w13, w2 = experts._weights()
        prefix = checkpoint_name(model, name + ".experts")
        assert torch.equal(dense_weights(w2, experts.group, torch.float32)[0], deq[f"{prefix}.0.down_proj.weight"])
        ids, weights = moe.route(x)
        got = experts(x, ids, weights, moe.act)
        assert torch.equal(got, fused_moe_int4_grouped(x, w13, w2, experts.group, ids, weights, moe.act))
        plain = fused_moe_int4_grouped(x, dataclasses.replace(w13, input_quant=""), dataclasses.replace(w2, input_quant=""),
                                       experts.group, ids, weights, moe.act)
        assert not torch.equal(got, plain)


@pytest.mark.parametrize("layout", ["compressed-tensors", "modelopt"])
def test_nvfp4_w4a4_experts_stay_packed_and_quantize_each_experts_input(layout, tiny_models, tmp_path) -> None:
    """NVFP4 with FP4 activations (llm-compressor's layout or ModelOpt's): the projections and the
    experts stay packed, every expert's input quantized to FP4 by its own calibrated scale (here
    a different one per expert and projection) in its format's arithmetic: eager, the float
    experts of the dequantized weights with exactly that quantization before each product, bit for
    bit. One expert's gate and up with different scales are named at start-up."""
    from quant_nvfp4 import write_modelopt_nvfp4_checkpoint, write_nvfp4_checkpoint
    from safetensors.torch import load_file, save_file

    from batonlm.kernels.fp4 import FP4_INPUTS
    from batonlm.kernels.moe import gated, grouped_by_expert
    from batonlm.model_runner.moe import Int4Experts
    from batonlm.model_runner.quantization.linear import PackedIntLinear

    path = tmp_path / "w4a4"
    linears = LINEARS + FAMILIES["qwen3_moe"]
    if layout == "modelopt":
        deq = write_modelopt_nvfp4_checkpoint(tiny_models["qwen3_moe"], path, linears, input_scale=1 / 300)
        name_of, value = "input_scale", lambda g: 1 / g
    else:
        deq = write_nvfp4_checkpoint(tiny_models["qwen3_moe"], path, linears, input_global_scale=300.0)
        name_of, value = "input_global_scale", lambda g: g
    tensors = load_file(str(path / "model.safetensors"))
    for key in list(tensors):  # each expert its own scales: gate and up one, down another
        match = re.search(r"\.experts\.(\d+)\.(gate|up|down)_proj\." + name_of + "$", key)
        if match:
            e = int(match.group(1))
            glob = 40.0 + 13 * e if match.group(2) != "down" else 3.0 + 2 * e
            tensors[key] = torch.tensor(value(glob)).reshape(tensors[key].shape).to(torch.float32)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = ModelConfig.from_hf(path)
    model = load_model(cfg, torch.float32, "cpu")[0]
    assert all(m.fp4_input_scale is not None for m in model.modules() if isinstance(m, PackedIntLinear))
    layers = _moe_layers(model)
    assert layers and all(isinstance(m.experts, Int4Experts) and m.experts.fp4_input == layout for _, m in layers)
    assert all(m.experts.w13_f is not None for _, m in layers)  # (the CPU keeps the dequantized operands)
    quantize = FP4_INPUTS[layout]
    x = torch.randn(11, cfg.hidden_size, generator=torch.Generator().manual_seed(6))
    for name, moe in layers:
        experts = moe.experts
        assert experts.w13_input_scale is not None and experts.w2_input_scale is not None
        assert len(set(experts.w13_input_scale.tolist())) == experts.w13_input_scale.numel()
        prefix = checkpoint_name(model, name + ".experts")
        w13 = [torch.cat([deq[f"{prefix}.{e}.gate_proj.weight"], deq[f"{prefix}.{e}.up_proj.weight"]])
               for e in range(experts.w13_qweight.shape[0])]
        w2 = [deq[f"{prefix}.{e}.down_proj.weight"] for e in range(len(w13))]

        def mlp(e: int, rows: torch.Tensor, experts=experts, w13=w13, w2=w2, moe=moe) -> torch.Tensor:
            h = gated(torch.nn.functional.linear(quantize(rows, experts.w13_input_scale[e]), w13[e]), moe.act)
            return torch.nn.functional.linear(quantize(h, experts.w2_input_scale[e]), w2[e])

        ids, weights = moe.route(x)
        want = grouped_by_expert(x, ids, weights, len(w13), x.shape[1], mlp)
        assert torch.equal(moe.experts(x, ids, weights, moe.act), want)
    key = next(k for k in tensors if k.endswith(f"experts.1.up_proj.{name_of}"))
    tensors[key] = tensors[key] * 2
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(QuantizationError, match=r"experts\.1\.up_proj: its " + name_of + " .* differs from its gate's"):
        load_model(ModelConfig.from_hf(path), torch.float32, "cpu")


def test_modelopts_nvfp4_moe_export_stays_packed_as_it_means(tmp_path) -> None:
    """ModelOpt 0.47's NVFP4 export of a tiny Qwen3-MoE (the `modelopt-nvfp4-moe` fixture, the
    layout of nvidia's *-FP4 MoE repositories: every expert's gate, up and down with its own
    `weight_scale_2` (gate and up one), and one `input_scale` for all the experts' gate/up inputs
    and one for their down inputs, ModelOpt calibrating the fused experts' inputs once): the
    experts stay packed with their float8 scales and give, bit for bit eager, the experts of the
    weights the format means (decoded here from its definition: E2M1 value * (weight_scale *
    weight_scale_2)) with every input quantized in ModelOpt's arithmetic."""
    from safetensors.torch import load_file

    from batonlm.kernels.fp4 import modelopt_nvfp4_fake_quant
    from batonlm.kernels.moe import gated, grouped_by_expert
    from batonlm.model_runner.moe import Int4Experts

    path = Path(__file__).resolve().parents[1] / "data" / "quantized" / "modelopt-nvfp4-moe"
    cfg = ModelConfig.from_hf(path)
    assert cfg.quantization is not None and cfg.quantization.description == "modelopt (NVFP4 weights and activations)"
    model = load_model(cfg, torch.float32, "cpu")[0]
    ((name, moe),) = _moe_layers(model)  # (layer 0 is a dense MLP)
    experts = moe.experts
    assert isinstance(experts, Int4Experts) and experts.fp4_input == "modelopt"
    assert experts.w13_scales.dtype == torch.float8_e4m3fn and experts.w13_input_scale is not None
    assert experts.w2_input_scale is not None and len(set(experts.w13_input_scale.tolist())) == 1  # (one for all)
    tensors = load_file(str(path / "model.safetensors"))
    table = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])

    def weight(prefix: str) -> torch.Tensor:  # the format's definition, codes low nibble first
        packed = tensors[f"{prefix}.weight"].long()
        codes = torch.stack([packed & 15, packed >> 4], dim=2).reshape(packed.shape[0], -1)
        scale = tensors[f"{prefix}.weight_scale"].float() * tensors[f"{prefix}.weight_scale_2"].float()
        return table[codes] * scale.repeat_interleave(16, dim=1)

    prefix = checkpoint_name(model, name + ".experts")
    count = experts.w13_qweight.shape[0]
    w13 = [torch.cat([weight(f"{prefix}.{e}.gate_proj"), weight(f"{prefix}.{e}.up_proj")]) for e in range(count)]
    w2 = [weight(f"{prefix}.{e}.down_proj") for e in range(count)]
    s13 = [tensors[f"{prefix}.{e}.gate_proj.input_scale"].float() for e in range(count)]
    s2 = [tensors[f"{prefix}.{e}.down_proj.input_scale"].float() for e in range(count)]

    def mlp(e: int, rows: torch.Tensor) -> torch.Tensor:
        h = gated(torch.nn.functional.linear(modelopt_nvfp4_fake_quant(rows, s13[e]), w13[e]), moe.act)
        return torch.nn.functional.linear(modelopt_nvfp4_fake_quant(h, s2[e]), w2[e])

    x = torch.randn(13, cfg.hidden_size, generator=torch.Generator().manual_seed(8))
    ids, weights = moe.route(x)
    want = grouped_by_expert(x, ids, weights, count, x.shape[1], mlp)
    assert torch.equal(experts(x, ids, weights, moe.act), want)


def _shared_order(name: str) -> str:
    """GPTQ orders the projections of one input together (q/k/v; an expert's gate and up)."""
    return re.sub(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj|w1|w3)\.weight$", ".input", name)


@pytest.fixture(scope="module")
def ordered_moe(tmp_path_factory) -> Path:
    from helpers import build_tiny_model
    from quant_formats import write_gptq_checkpoint

    root = tmp_path_factory.mktemp("ordered")
    build_tiny_model("mixtral", root / "mixtral", intermediate_size=96)  # experts of three groups of 32
    write_gptq_checkpoint(root / "mixtral", root / "gptq", group_size=32, sym=False, desc_act=True,
                          linears=LINEARS + FAMILIES["mixtral"], order_key=_shared_order)
    return root / "gptq"


def test_int4_experts_in_activation_order_are_the_dequantized_experts(ordered_moe) -> None:
    """GPTQ in activation order (desc_act): each expert's g_idx kept, its gate and up sharing one
    order; with float32 activations the dequantized experts' outputs, bit for bit; two ranks
    (48 of 96 features: any slice, each row keeps its group) sum to one."""
    from batonlm.kernels.moe import fused_moe_grouped, fused_moe_reference
    from batonlm.model_runner.moe import Int4Experts

    cfg = ModelConfig.from_hf(ordered_moe)
    model = load_model(cfg, torch.float32, "cpu", resident=True)[0]
    plain = load_model(cfg, torch.float32, "cpu", resident=False)[0]
    layers = _moe_layers(model)
    assert layers and all(isinstance(m.experts, Int4Experts) and m.experts.group == 0 for _, m in layers)
    ranks = [load_model(cfg, torch.float32, "cpu", TPGroup(r, 2), tp_layout(cfg, r, 2), resident=True)[0]
             for r in range(2)]
    g = torch.Generator().manual_seed(6)
    for name, moe in layers:
        experts = moe.experts
        assert experts.w13_g_idx is not None and experts.w2_g_idx is not None
        assert not torch.equal(experts.w2_g_idx[0], torch.arange(96, dtype=torch.int32) // 32)  # a real order
        floats = plain.get_submodule(name).experts
        assert isinstance(floats, FusedExperts)
        x = torch.randn(7, cfg.hidden_size, generator=g)
        ids, weights = moe.route(x)
        want = experts(x, ids, weights, moe.act)
        assert torch.equal(want, fused_moe_grouped(x, floats.w13, floats.w2, ids, weights, moe.act))
        got = sum(m.get_submodule(name).experts(x, ids, weights, moe.act) for m in ranks)
        mag = fused_moe_reference(x.double().abs(), floats.w13.double().abs(), floats.w2.double().abs(), ids,
                                  weights.double(), act=lambda v: v.abs())
        depth = cfg.hidden_size + floats.w2.shape[2] + ids.shape[1]
        assert ((got.double() - want.double()).abs() <= 4 * depth * torch.finfo(torch.float32).eps * mag).all()


def test_fp8_experts_are_dequantized_where_fp8_cannot_multiply(fp8_moe) -> None:
    """A GPU before compute capability 8.9 has no FP8 in Triton: there the experts load
    dequantized (the projections keep their torch references), as `multiplies_fp8` says."""
    from batonlm.model_runner.model_loader import build_meta_model, multiplies_fp8

    assert multiplies_fp8("cpu")
    assert multiplies_fp8("cuda") == (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9))
    cfg = ModelConfig.from_hf(fp8_moe["qwen3_moe"])
    model, layers = build_meta_model(cfg, torch.bfloat16, "cuda", resident=True)
    want = Fp8Experts if multiplies_fp8("cuda") else FusedExperts
    assert layers and all(isinstance(m.experts, want) for _, m in _moe_layers(model))


def test_mxfp8_experts_stay_packed_and_quantize_their_inputs(tiny_models, tmp_path) -> None:
    """MXFP8 experts (llm-compressor's layout, inputs quantized alike): `Int4Experts` with 8-bit
    codes through the e4m3 table, the exponents as bytes, and compressed-tensors' MXFP8 rule on
    both inputs (kernels/moe_int4.py's formulations are tested against it); their weights are the
    checkpoint's, and the input quantization changes the outputs."""
    from helpers import build_tiny_model
    from quant_mxfp8 import write_mxfp8_checkpoint

    build_tiny_model("qwen3_moe", tmp_path / "qwen3_moe", moe_intermediate_size=64, intermediate_size=128)
    path = tmp_path / "qwen3_moe-mxfp8"
    deq = write_mxfp8_checkpoint(tmp_path / "qwen3_moe", path, linears=LINEARS + FAMILIES["qwen3_moe"])
    cfg = ModelConfig.from_hf(path)
    model = load_model(cfg, torch.float32, "cpu")[0]  # (the CPU keeps MXFP8 packed: its inputs are quantized)
    assert all(m.experts.w13_scales.dtype == torch.uint8 and m.experts.group == 32 for _, m in _moe_layers(model))
    _packed_experts_quantize_their_inputs(model, cfg, deq, "mxfp8-compressed-tensors")


def test_nvfp4_awq_experts_are_named(tiny_models, tmp_path) -> None:
    """An expert with AWQ's pre_quant_scale before its FP4 inputs (NVFP4_AWQ experts) is named at
    start-up: dequantized experts would not quantize their inputs."""
    from quant_nvfp4 import write_modelopt_nvfp4_checkpoint
    from safetensors.torch import load_file, save_file

    from batonlm.model_runner.quantization.config import QuantizationError

    path = tmp_path / "awq"
    write_modelopt_nvfp4_checkpoint(tiny_models["qwen3_moe"], path, LINEARS + FAMILIES["qwen3_moe"], input_scale=1 / 300)
    tensors = load_file(str(path / "model.safetensors"))
    down = next(k for k in tensors if ".experts.0.down_proj.weight" in k and k.endswith("weight"))
    tensors[down.replace(".weight", ".pre_quant_scale")] = torch.ones(tensors[down].shape[1] * 2, dtype=torch.bfloat16)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(QuantizationError, match="experts with AWQ's pre_quant_scale before quantized inputs"):
        load_model(ModelConfig.from_hf(path), torch.float32, "cpu")
