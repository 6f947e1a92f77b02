"""MXFP8 checkpoints (FP8 e4m3 weights with a uint8 E8M0 exponent per 32 inputs): llm-compressor's
MXFP8 (inputs quantized alike, dynamically) and MXFP8A16 (weights only), compressed-tensors'
`mxfp8-quantized`, and NVIDIA ModelOpt's `MXFP8` (fixtures: tests/data/quantized/README.md).

References: the float32 model of the weights the format means (read by make_references.py from
its definition) with each layer's input quantized by its tool's own MXFP8 functions
(compressed-tensors' `compute_dynamic_scales_and_zp` + `fake_quantize`; ModelOpt's
`MXFP8QTensor`). transformers runs compressed-tensors' MXFP8 in bfloat16 only (it decompresses
the weights to bfloat16), so its logits are not the float32 reference here. Bound: the float32
one of tests/unit/test_quantized_checkpoints.py (1e-4 of the largest logit).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from test_quantized_checkpoints import DATA, RELATIVE, _prompt_logits, _reference, _runner

from batonlm.model_runner.model_config import ModelConfig
from batonlm.model_runner.quantization.linear import PackedIntLinear

FIXTURES = {
    "mxfp8": "compressed-tensors (mxfp8 activations)",
    "mxfp8a16": "compressed-tensors",
    "modelopt-mxfp8": "modelopt mxfp8 (weights and activations)",
}


def _want(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    ref = _reference(name)
    if "dequantized_greedy_ids" in ref:  # compressed-tensors' fixtures: the float32 reading, its greedy tokens
        return ref["dequantized_logits"], ref["dequantized_greedy_ids"]
    return ref["logits"], ref["greedy_ids"]  # ModelOpt's own reading (float32)


@pytest.mark.parametrize("resident", [None, True])
@pytest.mark.parametrize("name", list(FIXTURES))
def test_mxfp8_checkpoints_give_their_tools_logits(name: str, resident: bool | None) -> None:
    """Kept packed (CUDA's default; the CPU's too where the inputs are quantized), each layer holds
    1 byte a weight and 1 per 32 (its exponents as stored), and quantizes its inputs in its
    checkpoint tool's MXFP8 arithmetic; MXFP8A16 on the CPU is dequantized on load."""
    quant = ModelConfig.from_hf(DATA / name).quantization
    assert quant is not None and quant.description == FIXTURES[name]
    want, greedy = _want(name)
    ids = _reference(name)["input_ids"].reshape(-1)
    runner = _runner(DATA / name, resident)
    got = _prompt_logits(runner, ids)
    assert (got - want).abs().max() <= RELATIVE * want.abs().max()
    assert got.argmax(dim=-1)[-1] == greedy[0]
    packed = [m for m in runner.model.modules() if isinstance(m, PackedIntLinear)]
    activations = name != "mxfp8a16"
    assert len(packed) == (8 if resident or activations else 0)
    for m in packed:
        assert m.bits == 8 and m.group_size == 32 and m.codebook is not None and m.scales.dtype == torch.uint8
        held = sum(t.numel() * t.element_size() for t in (m.qweight, m.scales))
        assert held == m.n * m.k + m.n * m.k // 32
        assert (m.input_fake_quant is not None) == activations


def test_the_inputs_quantization_is_what_makes_the_logits(tmp_path: Path) -> None:
    """The MXFP8 fixture without its input quantization (its weights dequantized, inputs float)
    is far from its reference; declared MXFP8A16 (input_activations removed) it is MXFP8A16's
    meaning of the same weights: the dequantized model's logits."""
    want, _ = _want("mxfp8")
    ids = _reference("mxfp8")["input_ids"].reshape(-1)
    floats = _prompt_logits(_runner(DATA / "mxfp8", resident=False), ids)
    assert (floats - want).abs().max() > 10 * RELATIVE * want.abs().max()
    out = tmp_path / "mxfp8-as-a16"
    shutil.copytree(DATA / "mxfp8", out)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["input_activations"] = None
    (out / "config.json").write_text(json.dumps(config))
    packed = _prompt_logits(_runner(out, resident=True), ids)
    assert (packed - floats).abs().max() <= RELATIVE * floats.abs().max()


def test_mx_activations_batonlm_does_not_run_are_named(tmp_path: Path) -> None:
    out = tmp_path / "mx16"
    shutil.copytree(DATA / "mxfp8", out)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["input_activations"]["group_size"] = 16
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config_groups.group_0.input_activations: float 8-bit activations with E8M0 "
                                         r"scales per group of 16 are not supported \(supported: MXFP8's"):
        ModelConfig.from_hf(out)
