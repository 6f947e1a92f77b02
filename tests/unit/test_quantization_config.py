"""`--quantization` against a checkpoint's quantization_config: what loads, and one clear line
for what does not (the method, the field, what is supported)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from batonlm.model_runner.model_config import ModelConfig, ModelConfigError
from batonlm.model_runner.quantization.config import QuantizationError, resolve_quantization
from batonlm.model_runner.quantization.dequantized import FP8_E4M3_MAX, fp8_round_per_channel

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False, "sym": True}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
FP8_BLOCK = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
CT_W4A16 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
    "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128,
                                       "symmetric": True}}}, "ignore": ["lm_head"]}


def _ct_int8(**acts) -> dict:
    int8 = {"num_bits": 8, "type": "int", "symmetric": True}
    group = {"targets": ["Linear"], "weights": {**int8, "strategy": "channel"}, "input_activations": {**int8, **acts}}
    return {"quantization_config": {"quant_method": "compressed-tensors", "format": "int-quantized",
                                    "config_groups": {"group_0": group}}}


def test_which_activations_w8a8_quantizes(caplog) -> None:
    """int8 activations the kernels run: per token dynamically or per tensor statically,
    symmetric or with zero points; any other int8 scheme loads with one warning and unquantized
    activations."""
    for sym in (True, False):
        for scheme in (dict(strategy="token", dynamic=True), dict(strategy="tensor", dynamic=False)):
            got = resolve_quantization(_ct_int8(**scheme, symmetric=sym))
            assert got is not None and (got.act_quant, got.act_symmetric) == ("int8", sym)
    assert "asymmetric int8 activations" in resolve_quantization(_ct_int8(strategy="token", dynamic=True,
                                                                          symmetric=False)).description
    assert resolve_quantization({"quantization_config": FP8_BLOCK}).act_quant == "fp8"
    assert resolve_quantization({"quantization_config": CT_W4A16}).act_quant == "none"
    caplog.clear()
    assert resolve_quantization(_ct_int8(strategy="tensor", dynamic=True)).act_quant == "none"
    (record,) = caplog.records
    assert "dynamic tensor" in record.getMessage() and "W8A16" in record.getMessage()
    mixed = _ct_int8(strategy="token", dynamic=True)
    mixed["quantization_config"]["config_groups"]["group_1"] = {
        "targets": ["re:.*down_proj"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}
    with pytest.raises(QuantizationError, match="to fp8 and int8"):
        resolve_quantization(mixed)
    both = _ct_int8(strategy="token", dynamic=True)
    both["quantization_config"]["config_groups"]["group_1"] = {
        **both["quantization_config"]["config_groups"]["group_0"], "targets": ["re:.*down_proj"],
        "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": False}}
    with pytest.raises(QuantizationError, match="both symmetrically and asymmetrically"):
        resolve_quantization(both)


FP4_WEIGHTS = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True}


def test_the_checkpoints_method_is_read() -> None:
    assert resolve_quantization({}) is None
    gptq = resolve_quantization({"quantization_config": GPTQ})
    assert gptq is not None and (gptq.method, gptq.bits, gptq.group_size, gptq.sym) == ("gptq", 4, 64, True)
    assert gptq.checkpoint_format == "gptq"  # AutoGPTQ's and GPTQModel's default: zeros stored minus one
    awq = resolve_quantization({"quantization_config": AWQ}, "awq")
    assert awq is not None and (awq.method, awq.group_size, awq.sym) == ("awq", 128, False)
    fp8 = resolve_quantization({"quantization_config": FP8_BLOCK})
    assert fp8 is not None and fp8.block == (128, 128) and not fp8.online
    ct = resolve_quantization({"quantization_config": CT_W4A16})
    assert ct is not None and (ct.method, ct.group_size) == ("compressed-tensors", 128)
    nvfp4 = resolve_quantization({"quantization_config": {**CT_W4A16, "format": "nvfp4-pack-quantized",
                                                          "config_groups": {"g": {"weights": FP4_WEIGHTS}}}})
    assert nvfp4 is not None and (nvfp4.method, nvfp4.act_quant) == ("compressed-tensors", "none")
    assert nvfp4.description == "compressed-tensors (NVFP4 weights)"
    w4a4 = resolve_quantization({"quantization_config": {**CT_W4A16, "format": "nvfp4-pack-quantized",
                                                         "config_groups": {"g": {"weights": FP4_WEIGHTS, "input_activations": {
                                                             **FP4_WEIGHTS, "dynamic": "local"}}}}})
    assert w4a4 is not None and w4a4.act_quant == "fp4"
    modelopt = resolve_quantization({"quantization_config": {"quant_method": "modelopt", "quantization": {
        "quant_algo": "NVFP4", "group_size": 16}}})  # (hf_quant_config.json's layout)
    assert modelopt is not None and (modelopt.act_quant, modelopt.fp4, modelopt.group_size) == ("fp4", "NVFP4", 16)
    fp8_only = resolve_quantization({"quantization_config": {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION",
                                                             "quantized_layers": {"a.q_proj": {"quant_algo": "FP8"}}}})
    assert fp8_only is not None and (fp8_only.act_quant, fp8_only.fp4, fp8_only.mixed) == ("fp8", "", ("FP8",))
    online = resolve_quantization({}, "fp8")
    assert online is not None and online.online and online.method == "fp8"


@pytest.mark.parametrize("raw, flag, words", [
    ({"quantization_config": {"quant_method": "hqq"}}, "auto",
     ["'hqq'", "quant_method", "fp8, compressed-tensors, gptq, awq, modelopt, bitsandbytes"]),
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, "auto", ["bitsandbytes", "load_in_4bit", "nf4"]),
    ({"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "int4"}},
     "auto", ["bnb_4bit_quant_type", "'int4'", "nf4, fp4"]),
    ({"quantization_config": GPTQ}, "none", ["gptq", "--quantization none"]),
    ({"quantization_config": GPTQ}, "awq", ["--quantization awq", "gptq"]),
    ({}, "gptq", ["--quantization gptq", "not quantized"]),
    ({"quantization_config": {**GPTQ, "bits": 3}}, "auto", ["gptq", "bits", "3", "4, 8"]),
    ({"quantization_config": {**GPTQ, "checkpoint_format": "marlin"}}, "auto", ["checkpoint_format", "'marlin'"]),
    ({"quantization_config": {**AWQ, "version": "gemv"}}, "auto", ["awq", "version", "'gemv'", "gemm"]),
    ({"quantization_config": {**FP8_BLOCK, "weight_block_size": [128]}}, "auto", ["weight_block_size"]),
    ({"quantization_config": {**FP8_BLOCK, "activation_scheme": "smooth"}}, "auto", ["activation_scheme"]),
    ({"quantization_config": {**CT_W4A16, "format": "marlin-24"}}, "auto", ["compressed-tensors", "'marlin-24'"]),
    ({"quantization_config": {**CT_W4A16, "config_groups": {"g": {"weights": {
        "num_bits": 2, "type": "int", "strategy": "group"}}}}}, "auto", ["int 2-bit", "int 4-bit"]),
    ({"quantization_config": {**CT_W4A16, "sparsity_config": {"format": "sparse-24"}}}, "auto", ["sparsity"]),
    # NVFP4 with FP4 activations (W4A4), and float 4-bit in other groups (MXFP4's 32, E8M0 scales)
    ({"quantization_config": {**CT_W4A16, "format": "nvfp4-pack-quantized", "config_groups": {"g": {
        "weights": FP4_WEIGHTS, "input_activations": {**FP4_WEIGHTS, "strategy": "group", "group_size": 32,
                                                      "dynamic": True}}}}}, "auto",
     ["input_activations", "float 4-bit", "NVFP4's"]),
    ({"quantization_config": {**CT_W4A16, "format": "mxfp6-quantized"}}, "auto", ["'mxfp6-quantized'"]),
    ({"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 32}}, "auto",
     ["modelopt NVFP4", "group_size", "32", "16"]),
    ({"quantization_config": {"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"}}, "auto",
     ["'W4A8_AWQ'", "MXFP8, NVFP4, NVFP4_AWQ, W4A16_AWQ, W4A16_NVFP4, W8A16, MIXED_PRECISION"]),
    ({"quantization_config": {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "quantized_layers": {
        "model.layers.0.mlp.down_proj": {"quant_algo": "W4A8_AWQ"}}}}, "auto",
     ["quantized_layers.model.layers.0.mlp.down_proj.quant_algo", "'W4A8_AWQ'", "FP8, FP8_PB_WO, NVFP4"]),
    ({"quantization_config": {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION"}}, "auto",
     ["MIXED_PRECISION quantized_layers is missing"]),
    ({"quantization_config": {**CT_W4A16, "config_groups": {"g": {"weights": {
        **FP4_WEIGHTS, "strategy": "group", "group_size": 64}}}}}, "auto", ["float 4-bit", "'group'", "64", "MXFP4"]),
])
def test_an_unloadable_config_is_one_clear_line(raw: dict, flag: str, words: list[str]) -> None:
    with pytest.raises(QuantizationError) as e:
        resolve_quantization(raw, flag)
    message = str(e.value)
    assert "\n" not in message
    for word in words:
        assert word in message, (word, message)


def test_a_model_directory_with_a_bad_config_fails_at_start(tmp_path, stories_path) -> None:
    model = tmp_path / "m"
    shutil.copytree(stories_path, model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "hqq"}}))
    with pytest.raises(ModelConfigError, match=r"config\.json.*'hqq'.*supported"):
        ModelConfig.from_hf(model)
    with pytest.raises(ModelConfigError, match="needs a checkpoint quantized with awq"):
        ModelConfig.from_hf(stories_path, quantization="awq")


def test_online_fp8_rounds_each_channel_within_half_a_step() -> None:
    """e4m3 has 3 mantissa bits: a value's nearest e4m3 is within 2^-4 of it relatively (normal
    range), and below the smallest normal (2^-6) within half the subnormal step 2^-10 (scaled by
    the row's scale). Rows are scaled so their largest value is 448 (kept exactly)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 96, generator=g, dtype=torch.float64) * torch.logspace(-3, 1, 64, dtype=torch.float64)[:, None]
    w[5] = 0  # an all-zero row stays zero
    r = fp8_round_per_channel(w.float()).double()
    scale = (w.abs().amax(1, keepdim=True) / FP8_E4M3_MAX).clamp_min(1e-30)
    bound = torch.maximum(w.abs() * 2.0**-4, scale * 2.0**-10) * (1 + 1e-6) + w.abs() * 2.0**-23
    assert ((r - w).abs() <= bound).all()
    assert (r[5] == 0).all()
    # Each row's largest value maps to 448, exact in e4m3: it comes back within float32's rounding.
    top = w.float().double().abs().amax(1)
    assert ((r.abs().amax(1) - top).abs() <= top * 2.0**-22).all()
