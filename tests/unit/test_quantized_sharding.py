"""Tensor parallelism of quantized checkpoints: each rank's projections, quantized or
dequantized, are its rows (column-parallel: the ranks' outputs side by side give the whole
output) or its columns (row-parallel: the ranks' partial products sum to it) of the one-rank
model's, scales, zeros and blocks sharded with their weights; a slice that would split an FP8
block or an int4 group is refused at start-up, naming the layer.

Computed in float64, where the ranks' other summation order errs below 1e-12 (FP8 layers compute
in float32, their kernels' accumulator: K terms err by K * 2^-24 on each side). W8A8 with
per-token activation scales (FP8 dynamic) is the exception: a row-parallel rank quantizes its
own slice of each token with the slice's own scale, so the ranks' sum differs from the one-rank
product by activation rounding: each side errs by at most half an e4m3 step, 2^-4 of each
activation, so they differ by at most 2^-3 * sum |x| |W|. Int8 W8A8 likewise, with half an int8
step of the token's (or its slice's) scale, amax / 255, on each activation (with zero points,
half of (max - min) / 255, no more): at most 2 / 255 * amax(|x|) * sum |W| apart.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from quant_fbgemm import write_fbgemm_fp8_checkpoint
from quant_formats import write_fp8_block_checkpoint

from batonlm.model_runner.model_config import ModelConfig
from batonlm.model_runner.model_loader import load_model, tp_layout
from batonlm.model_runner.quantization.config import QuantizationError
from batonlm.model_runner.quantization.linear import Fp8Linear, Int8Linear, LlmInt8Linear, PackedIntLinear

DATA = Path(__file__).resolve().parents[1] / "data" / "quantized"
LAYER = "model.layers.1."


@pytest.fixture(scope="module")
def fp8_block64(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fp8") / "fp8-block64"
    write_fp8_block_checkpoint(DATA / "fp32-source", out, block=(64, 64))
    return out


@pytest.fixture(scope="module")
def fbgemm_fp8(tmp_path_factory) -> Path:
    """FBGEMM FP8 with its activations' amax capped at 2 (of random inputs' ~3): a rank's slice of
    a token saturates where the whole token does (a value over the cap is over it in either)."""
    out = tmp_path_factory.mktemp("fbgemm") / "fbgemm-fp8"
    write_fbgemm_fp8_checkpoint(DATA / "fp32-source", out, ub=2.0)
    return out


def _models(path: Path, resident: bool, size: int = 2, quantization: str = "auto"):
    cfg = ModelConfig.from_hf(path, quantization=quantization)
    full = load_model(cfg, torch.float64, "cpu", resident=resident)[0]
    ranks = [load_model(cfg, torch.float64, "cpu", shard=tp_layout(cfg, r, size), resident=resident)[0]
             for r in range(size)]
    return cfg, full, ranks


@pytest.mark.parametrize("name, resident, kind", [
    ("gptqmodel-w4g64", True, PackedIntLinear),
    ("gptqmodel-awq-w4g64", True, PackedIntLinear),
    ("w4a16-asym", False, None),  # groups of 128: two ranks' 192 down_proj columns need it dequantized
    ("gptqmodel-w4g64-asym-descact", False, None),
    ("gptqmodel-w4g64-asym-descact", True, PackedIntLinear),  # activation order: a rank's rows keep their groups
    ("w8a16", False, None),
    ("fp8-block64", True, Fp8Linear),
    ("fp8-dynamic", True, Fp8Linear),
    ("fp8-mixed-wo", True, Fp8Linear),  # FP8_DYNAMIC attention, the MLP's FP8 weight-only (packed codes)
    ("fbgemm-fp8", True, Fp8Linear),  # per token, each token's amax capped
    ("w8a8", True, Int8Linear),
    ("w8a8-static", True, Int8Linear),  # one input scale for every rank: only float32's rounding apart
    ("w8a8-asym", True, Int8Linear),  # per token with zero points: each rank's slice its own range
    ("w8a8-static-asym", True, Int8Linear),  # one scale and zero point: each rank's weight sums its columns'
    ("online-fp8", True, Fp8Linear),  # --quantization fp8 of the float source, kept FP8 (CUDA's default)
    ("bnb-nf4", True, PackedIntLinear),  # bitsandbytes NF4 with its codebook: blocks of 64 inputs are whole groups
    ("bnb-int8", True, LlmInt8Linear),
    ("nvfp4a16", True, PackedIntLinear),  # NVFP4: groups of 16 inputs, FP4 codes through the E2M1 table
    ("nvfp4", True, PackedIntLinear),  # W4A4: a group of 16 inputs quantized alike in a rank's whole groups
    ("modelopt-w4a16-nvfp4", True, PackedIntLinear),  # ModelOpt's layout of NVFP4: its scale_2 multiplies
    ("modelopt-nvfp4", True, PackedIntLinear),  # ModelOpt's W4A4: its input_scale, ModelOpt's arithmetic
    ("modelopt-mixed", True, Fp8Linear),  # MIXED_PRECISION: static FP8 attention, NVFP4 W4A4 MLP
    ("modelopt-mixed-pb-wo", True, PackedIntLinear),  # FP8_PB_WO attention (8-bit codes, e4m3 table), NVFP4 MLP
    ("modelopt-fp8-pb-wo", False, None),  # 128x128 blocks: two ranks' 192 down_proj inputs need it dequantized
    ("modelopt-w8a16", True, PackedIntLinear),  # int8 weight-only, a scale per row
    ("modelopt-int4-awq", False, None),  # groups of 128 (192 down_proj inputs a rank): pre_quant_scale folded
    ("mxfp8", True, PackedIntLinear),  # MXFP8: groups of 32 (a rank's slice of a token quantizes its whole groups)
    ("modelopt-mxfp8", True, PackedIntLinear),  # ModelOpt's MXFP8
    ("mxfp4", True, PackedIntLinear),  # MXFP4 inputs too: a rank's slice of a token quantizes its whole groups
    ("mxfp4a16", True, PackedIntLinear),  # MXFP4: groups of 32 (two ranks' 192 down_proj inputs: 6 each)  # LLM.int8: a row-parallel rank's slice of a row its own statistic
])
def test_each_ranks_projections_are_its_part_of_the_whole(name, resident, kind, fp8_block64, fbgemm_fp8) -> None:
    path = {"fp8-block64": fp8_block64, "fbgemm-fp8": fbgemm_fp8, "online-fp8": DATA / "fp32-source"}.get(name, DATA / name)
    cfg, full, ranks = _models(path, resident, quantization="fp8" if name == "online-fp8" else "auto")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, cfg.hidden_size, generator=g, dtype=torch.float64)
    per_token = name in ("fp8-dynamic", "fp8-mixed-wo", "fbgemm-fp8", "online-fp8")

    def module(model, proj):
        return model.get_submodule(LAYER + proj)

    def close(got, want, x_in, proj, model=full):
        w = _dense_weight(module(model, proj), x_in.shape[1])
        # FP8 layers compute in float32 (their kernels' accumulator): K terms err by K * 2^-24 each side.
        rounding = x_in.shape[1] * 2.0**-23 if kind in (Fp8Linear, Int8Linear, LlmInt8Linear) else 1e-12
        bound = (2.0**-3 if per_token else rounding) * (x_in.abs() @ w.abs().T).max()
        if name in ("w8a8", "w8a8-asym"):  # per-token int8 activations (half a step: amax / 255 at most)
            bound += 2 / 255 * (x_in.abs().amax(dim=1, keepdim=True) @ w.abs().sum(dim=1, keepdim=True).T).max()
        if name == "bnb-int8":  # LLM.int8: half a step of a row's statistic (at most its amax / 254) each
            # side, of a float16 copy of x (2^-11 of each |x|) each side
            bound += 2 / 254 * (x_in.abs().amax(dim=1, keepdim=True) * (1 + 2.0**-11) @ w.abs().sum(dim=1, keepdim=True).T
                                ).max() + 2 * 2.0**-11 * (x_in.abs() @ w.abs().T).max()
        assert (got - want).abs().max() <= bound, (name, proj)

    if kind is not None:
        assert isinstance(module(ranks[0], "self_attn.qkv_proj"), kind)
    # Column-parallel: the fused q/k/v and gate/up rows of each rank.
    qkv = module(full, "self_attn.qkv_proj")(x)
    q_full, kv_full = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    gate_up = module(full, "mlp.gate_up_proj")(x)
    for m in ranks:
        out = module(m, "self_attn.qkv_proj")(x)
        (qs, qc), (ks, kc) = m.shard.q_rows(), m.shard.kv_rows()
        want = torch.cat([qkv[:, qs : qs + qc], qkv[:, q_full + ks : q_full + ks + kc],
                          qkv[:, q_full + kv_full + ks : q_full + kv_full + ks + kc]], dim=1)
        close(out, want, x, "self_attn.qkv_proj")
        ms, mc = m.shard.mlp_rows()
        out = module(m, "mlp.gate_up_proj")(x)
        inter = cfg.intermediate_size
        close(out, torch.cat([gate_up[:, ms : ms + mc], gate_up[:, inter + ms : inter + ms + mc]], dim=1), x,
              "mlp.gate_up_proj")
    # Row-parallel: each rank's columns, summed.
    for proj, width, rows in (("self_attn.o_proj", q_full, lambda s: s.q_rows()),
                              ("mlp.down_proj", cfg.intermediate_size, lambda s: s.mlp_rows())):
        h = torch.randn(3, width, generator=g, dtype=torch.float64)
        parts = [module(m, proj)(h[:, rows(m.shard)[0] : sum(rows(m.shard))]) for m in ranks]
        close(sum(parts), module(full, proj)(h), h, proj)


def _dense_weight(mod, k: int) -> torch.Tensor:
    """The layer's weight as a float64 [N, K] (a quantized layer's by its product with I)."""
    inner = getattr(mod, "local", None) or mod
    if isinstance(inner, Int8Linear):
        return inner.weight_q.double() * inner.weight_scale.double()[:, None]
    if isinstance(inner, LlmInt8Linear):
        return inner.weight_q.double() * inner.weight_scale.double()[:, None] / 127
    if isinstance(inner, (Fp8Linear, PackedIntLinear)):
        from batonlm.kernels.int4 import dequantize_int4
        from batonlm.kernels.quant import dequantize_fp8, dequantize_fp8_block

        if isinstance(inner, PackedIntLinear):
            return dequantize_int4(inner.qweight, inner.scales, inner.zeros, inner.group_size, k, torch.float64,
                                   inner.g_idx, inner.bits, inner.codebook)
        if inner.block is not None:
            return dequantize_fp8_block(inner.weight_q, inner.weight_scale, inner.block, torch.float64)
        return dequantize_fp8(inner.weight_q, inner.weight_scale, torch.float64)
    return mod.weight


def test_a_slice_that_would_split_a_block_or_group_is_refused() -> None:
    """128x128 FP8 blocks: two ranks' 64 K/V rows each split a block. int4 groups of 128 over
    down_proj's 384 input features: two ranks' 192 each split a group; weight-only FP8 blocks
    (kept packed as groups of 128 inputs) likewise. (A packed weight-only block's rows each hold
    its scale: a rank's rows may split it.)"""
    for name, words in (("fp8-block", ["qkv_proj", "k_proj", "FP8 128x128 blocks", "--tp"]),
                        ("w4a16", ["down_proj", "groups of 128 rows", "--tp"]),
                        ("modelopt-fp8-pb-wo", ["down_proj", "groups of 128 rows", "--tp"]),
                        ("w4afp8", ["down_proj", "groups of 128 rows", "--tp"])):  # (its inputs quantized: packed only)
        cfg = ModelConfig.from_hf(DATA / name)
        with pytest.raises(QuantizationError) as e:
            load_model(cfg, torch.float32, "cpu", shard=tp_layout(cfg, 1, 2), resident=True)
        for word in words:
            assert word in str(e.value), (word, str(e.value))
        # Dequantized on load any slice is exact: the weight-only format loads.
        if name in ("w4a16", "modelopt-fp8-pb-wo"):
            load_model(cfg, torch.float32, "cpu", shard=tp_layout(cfg, 1, 2), resident=False)
