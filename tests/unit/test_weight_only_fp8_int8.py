"""Weight-only FP8 and int8 checkpoints: their inputs stay float (W8A16), so they are not W8A8
`Fp8Linear`s. NVIDIA ModelOpt's FP8_PB_WO (FP8 weights, a float32 scale per 128x128 block), its
W8A16 (int8 weights, a scale per output channel), its MIXED_PRECISION export with FP8_PB_WO
layers beside NVFP4 ones (fixtures exported by ModelOpt 0.47, references ModelOpt's own reading:
tests/data/quantized/README.md), and compressed-tensors FP8 without `input_activations`.

Dequantized on load (the CPU's default) or kept packed as 8-bit codes (CUDA's: FP8's through
the table of its 256 values, `fp8_weight_only.py`), they give the float32 model of the weights
they mean, to the float32 bound of tests/unit/test_quantized_checkpoints.py (1e-4 of the
largest logit).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from test_quantized_checkpoints import DATA, RELATIVE, _prompt_logits, _reference, _runner

from batonlm.model_runner.model_config import ModelConfig
from batonlm.model_runner.quantization.linear import Fp8Linear, PackedIntLinear

# ModelOpt's FP8_PB_WO, W8A16 and MIXED_PRECISION (FP8_PB_WO attention, NVFP4 W4A4 MLP) fixtures.
MODELOPT = {
    "modelopt-fp8-pb-wo": "modelopt fp8 (128x128 blocks, weight-only)",
    "modelopt-w8a16": "modelopt int8 (per channel, weight-only)",
    "modelopt-mixed-pb-wo": "modelopt mixed precision (FP8_PB_WO and NVFP4 layers; FP8_PB_WO weight-only, the "
                            "others' activations quantized)",
}


def _eight_bit(runner) -> list[PackedIntLinear]:
    return [m for m in runner.model.modules() if isinstance(m, PackedIntLinear) and m.bits == 8]


@pytest.mark.parametrize("resident", [None, True])
@pytest.mark.parametrize("name", list(MODELOPT))
def test_modelopt_weight_only_layers_give_modelopts_dequantized_logits(name: str, resident: bool | None) -> None:
    """Kept packed, every weight-only layer holds 1 byte a weight (its codes; FP8 through the
    e4m3 table) and a float32 scale per output row and group of 128 inputs (FP8_PB_WO) or per row
    (W8A16); the MIXED_PRECISION export's NVFP4 layers stay W4A4."""
    quant = ModelConfig.from_hf(DATA / name).quantization
    assert quant is not None and quant.description == MODELOPT[name]
    ref = _reference(name)
    ids = ref["input_ids"].reshape(-1)
    runner = _runner(DATA / name, resident)
    got = _prompt_logits(runner, ids)
    assert (got - ref["logits"]).abs().max() <= RELATIVE * ref["logits"].abs().max()
    assert not any(isinstance(m, Fp8Linear) for m in runner.model.modules())
    packed = _eight_bit(runner)
    kept = resident or name == "modelopt-mixed-pb-wo"  # (W4A4 layers stay quantized on the CPU too)
    layers = 4 if name == "modelopt-mixed-pb-wo" else 8  # qkv and o per layer (+ gate/up, down)
    assert len(packed) == (layers if kept else 0)
    fp8 = "pb-wo" in name
    for m in packed:
        assert m.qweight.numel() * m.qweight.element_size() == m.n * m.k
        assert (m.codebook is not None) == fp8 and (m.zeros is None) == fp8  # int8: its zero of 128 (signed codes)
        assert m.scales.dtype == torch.float32 and m.scales.shape == (-(-m.k // 128) if fp8 else 1, m.n)
    if name == "modelopt-mixed-pb-wo":
        nvfp4 = [m for m in runner.model.modules() if isinstance(m, PackedIntLinear) and m.bits == 4]
        assert len(nvfp4) == 4 and all(m.fp4_input_scale is not None for m in nvfp4)


@pytest.mark.parametrize("name", ["fp8-dynamic", "fp8-block"])
def test_compressed_tensors_fp8_without_input_activations_is_weight_only(name: str, tmp_path: Path) -> None:
    """llm-compressor's FP8 tensors with the config's `input_activations` removed mean FP8
    weights and float inputs: kept packed (8-bit codes through the e4m3 table, per channel or per
    128x128 block) they give the dequantized weights' logits, which differ from the W8A8
    fixture's (its inputs quantized) by far more than the bound."""
    out = tmp_path / f"{name}-weight-only"
    shutil.copytree(DATA / name, out)
    config = json.loads((out / "config.json").read_text())
    for group in config["quantization_config"]["config_groups"].values():
        group["input_activations"] = None
    (out / "config.json").write_text(json.dumps(config))
    ids = _reference(name)["input_ids"].reshape(-1)
    dequantized = _prompt_logits(_runner(out, resident=False), ids)
    runner = _runner(out, resident=True)
    packed = _eight_bit(runner)
    assert len(packed) == 8 and not any(isinstance(m, Fp8Linear) for m in runner.model.modules())
    got = _prompt_logits(runner, ids)
    bound = RELATIVE * dequantized.abs().max()
    assert (got - dequantized).abs().max() <= bound
    w8a8 = _prompt_logits(_runner(DATA / name), ids)
    assert (w8a8 - dequantized).abs().max() > 10 * bound


def test_a_block_scale_of_the_wrong_shape_is_named(tmp_path: Path) -> None:
    """An FP8_PB_WO scale that is not one per 128x128 block of its weight stops start-up naming it."""
    from safetensors.torch import load_file, save_file

    out = tmp_path / "bad"
    shutil.copytree(DATA / "modelopt-fp8-pb-wo", out)
    tensors = load_file(str(out / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight_scale"
    tensors[name] = tensors[name][:, :, :2].contiguous()  # [2, 1, 2, 1]: K = 384 has three blocks of 128
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{name} of shape \(2, 1, 2, 1\) is not a scale per tensor, channel or "
                                         r"128x128 block of a \[256, 384\] FP8 weight"):
        _runner(out, resident=True)


@pytest.mark.parametrize("resident", [None, True])
def test_modelopt_int4_awq_multiplies_its_inputs_by_the_pre_quant_scale(resident: bool | None, tmp_path: Path) -> None:
    """ModelOpt's W4A16_AWQ (INT4_AWQ_CFG exported, `modelopt-int4-awq`): symmetric int4 codes two a
    byte along N, a float32 scale per 128 inputs, AWQ's `pre_quant_scale` on o_proj's and
    down_proj's inputs (the norms took q/k/v's and gate/up's). Dequantized on load (the CPU's
    default: the scale folded into the weight's columns) or kept packed (CUDA's: the layer
    multiplies its input by it), ModelOpt's reading's logits to the float32 bound; without the
    pre_quant_scale they are far off."""
    from safetensors.torch import load_file, save_file

    name = "modelopt-int4-awq"
    quant = ModelConfig.from_hf(DATA / name).quantization
    assert quant is not None and quant.description == "modelopt int4 AWQ (weight-only, pre-quant scales)"
    ref = _reference(name)
    ids = ref["input_ids"].reshape(-1)
    runner = _runner(DATA / name, resident)
    got = _prompt_logits(runner, ids)
    bound = RELATIVE * ref["logits"].abs().max()
    assert (got - ref["logits"]).abs().max() <= bound
    packed = {n.removesuffix(".local"): m for n, m in runner.model.named_modules() if isinstance(m, PackedIntLinear)}
    assert len(packed) == (8 if resident else 0)
    for n, m in packed.items():
        assert m.bits == 4 and m.group_size == 128 and m.qweight.numel() * 4 == m.n * m.k // 2
        assert (m.pre_quant_scale is not None) == n.endswith(("o_proj", "down_proj"))
    out = tmp_path / "no-pqs"
    shutil.copytree(DATA / name, out)
    tensors = {k: v for k, v in load_file(str(out / "model.safetensors")).items() if not k.endswith("pre_quant_scale")}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    assert (_prompt_logits(_runner(out, resident), ids) - ref["logits"]).abs().max() > 10 * bound


def test_a_modelopt_int4_with_zero_points_is_named(tmp_path: Path) -> None:
    out = tmp_path / "zeros"
    shutil.copytree(DATA / "modelopt-int4-awq", out)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["has_zero_point"] = True
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="modelopt W4A16_AWQ has_zero_point true is not supported"):
        ModelConfig.from_hf(out)
