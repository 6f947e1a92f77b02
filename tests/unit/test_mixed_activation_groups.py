"""compressed-tensors config groups that disagree on quantizing their inputs: FP8_DYNAMIC attention
beside FP8 weight-only MLP layers (`fp8-mixed-wo`, written by llm-compressor), each layer run as
its group says, the group found by compressed-tensors' own rules (`QuantConfig.act_targets`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from test_quantized_checkpoints import DATA, RELATIVE, _prompt_logits, _reference, _runner

from batonlm.model_runner.quantization.config import resolve_quantization
from batonlm.model_runner.quantization.linear import Fp8Linear, PackedIntLinear
from batonlm.model_runner.quantization.quant_config import QuantConfig, QuantizationError, group_target

FIXTURE = DATA / "fp8-mixed-wo"


def _quant(groups: dict) -> QuantConfig:
    raw = json.loads((FIXTURE / "config.json").read_text())
    raw["quantization_config"]["config_groups"] = groups
    return resolve_quantization(raw)


def test_each_layer_runs_as_its_group_says_and_gives_transformers_logits() -> None:
    """Attention (group "re:.*self_attn.*": per-token FP8 inputs) stays W8A8 `Fp8Linear`; the MLP
    (group "Linear", no input_activations) runs weight-only, its FP8 codes packed. The logits are
    transformers + compressed-tensors' (which equal the dequantized weights with only the
    attention's inputs quantized, bit for bit: make_references.py); quantizing every layer's
    inputs, as one activation scheme per checkpoint did, is over 100x the bound off (870x here)."""
    ref = _reference("fp8-mixed-wo")
    runner = _runner(FIXTURE)
    layer = runner.model.get_submodule("model.layers.0")
    assert isinstance(layer.self_attn.qkv_proj, Fp8Linear) and isinstance(layer.self_attn.o_proj.local, Fp8Linear)
    assert isinstance(layer.mlp.gate_up_proj, PackedIntLinear) and isinstance(layer.mlp.down_proj.local, PackedIntLinear)
    ids = ref["input_ids"].reshape(-1)
    bound = RELATIVE * ref["logits"].abs().max()
    assert (_prompt_logits(runner, ids) - ref["logits"]).abs().max() <= bound
    everywhere = _runner(DATA / "fp8-dynamic")  # the same codes, every layer's inputs quantized
    assert (_prompt_logits(everywhere, ids) - ref["logits"]).abs().max() > 100 * bound
    assert "weight-only where its config groups say" in runner.cfg.quantization.description


def test_a_layer_takes_its_scheme_from_compressed_tensors_first_matching_target() -> None:
    """compressed-tensors' `match_targets` order: an exact name, then a regular expression
    (matched from the start), each kind in sorted order, then the class name "Linear"."""
    name = "model.layers.3.self_attn.q_proj"
    assert group_target(name, ["Linear", "re:.*self_attn.*"]) == "re:.*self_attn.*"
    assert group_target(name, ["re:.*q_proj", name, "Linear"]) == name
    assert group_target(name, ["re:.*self_attn.*", "re:.*q_proj"]) == "re:.*q_proj"  # sorted: "re:.*q" < "re:.*s"
    assert group_target(name, ["re:self_attn"]) is None  # re.match: from the name's start
    assert group_target(name, ["Linear"]) == "Linear"
    assert group_target(name, ["model.layers.3.self_attn", "re:.*mlp.*"]) is None


def test_the_groups_become_targets_later_groups_overriding() -> None:
    group = json.loads((FIXTURE / "config.json").read_text())["quantization_config"]["config_groups"]
    attn, rest = group["group_0"], group["group_1"]
    quant = _quant({"a": attn, "b": rest})
    assert quant.act_quant == "fp8"
    assert dict(quant.act_targets) == {"re:.*self_attn.*": True, "Linear": False}
    assert quant.quantizes_inputs("model.layers.0.self_attn.o_proj")
    assert not quant.quantizes_inputs("model.layers.0.mlp.down_proj")
    # the same target in two groups: the later group's scheme (compressed-tensors' target map)
    quant = _quant({"a": attn, "b": dict(rest, targets=["re:.*self_attn.*", "Linear"])})
    assert not quant.quantizes_inputs("model.layers.0.self_attn.o_proj")
    # groups that agree keep one scheme for all (no targets to match)
    assert _quant({"a": attn, "b": dict(attn, targets=["Linear"])}).act_targets == ()
    assert _quant({"a": rest}).act_quant == "none"


def test_layers_fused_into_one_input_must_agree(tmp_path: Path) -> None:
    """q_proj quantizing its inputs and k/v_proj not: batonlm runs them as one projection of one
    input, so start-up names the module and both sides."""
    out = tmp_path / "split"
    shutil.copytree(FIXTURE, out)
    raw = json.loads((out / "config.json").read_text())
    raw["quantization_config"]["config_groups"]["group_0"]["targets"] = ["re:.*q_proj"]
    (out / "config.json").write_text(json.dumps(raw))
    with pytest.raises(QuantizationError, match=r"layers\.0\.self_attn\.qkv_proj: the config groups quantize the "
                       r"inputs of model\.layers\.0\.self_attn\.q_proj and not of model\.layers\.0\.self_attn\.k_proj "
                       r"\(and 1 more\)"):
        _runner(out)


def test_weight_only_groups_beside_int8_schemes_the_kernels_do_not_run_stay_float_inputs() -> None:
    """A group whose int8 activations are of a scheme batonlm does not run (per-group, here) runs
    W8A16 (warned) also beside a W8A8 group: its layers are weight-only, not the other's W8A8."""
    int8 = {"num_bits": 8, "type": "int", "symmetric": True}
    w8a8 = {"targets": ["re:.*mlp.*"], "weights": dict(int8, strategy="channel"),
            "input_activations": dict(int8, strategy="token", dynamic=True)}
    odd = {"targets": ["Linear"], "weights": dict(int8, strategy="channel"),
           "input_activations": dict(int8, strategy="group", group_size=128, dynamic=True)}
    raw = json.loads((DATA / "w8a8" / "config.json").read_text())
    raw["quantization_config"]["config_groups"] = {"g0": w8a8, "g1": odd}
    quant = resolve_quantization(raw)
    assert quant.act_quant == "int8"
    assert quant.quantizes_inputs("model.layers.1.mlp.up_proj")
    assert not quant.quantizes_inputs("model.layers.1.self_attn.v_proj")


def _with_groups(src: Path, out: Path, split: bool) -> Path:
    """`src` with its one config group split: the attention's keeps its input_activations, every
    other layer's (the MLP's) has none (`split`), or every layer's none."""
    shutil.copytree(src, out)
    raw = json.loads((out / "config.json").read_text())
    (group,) = raw["quantization_config"]["config_groups"].values()
    groups = {"attention": dict(group, targets=["re:.*self_attn.*"]), "rest": dict(group, input_activations=None)}
    raw["quantization_config"]["config_groups"] = groups if split else {"rest": groups["rest"]}
    (out / "config.json").write_text(json.dumps(raw))
    return out


@pytest.mark.parametrize("name", ["nvfp4", "mxfp8"])
def test_fp4_and_mxfp8_inputs_are_quantized_only_where_the_group_says(name: str, tmp_path: Path) -> None:
    """NVFP4 (W4A4) and MXFP8 layers beside their weight-only twins (NVFP4A16, MXFP8A16) in one
    checkpoint: the attention's projections are the W4A4 / MXFP8 checkpoint's bit for bit, the
    MLP's the weight-only one's, which differ."""
    mixed = _runner(_with_groups(DATA / name, tmp_path / "mixed", split=True), resident=True).model
    quantized = _runner(DATA / name, resident=True).model
    weight_only = _runner(_with_groups(DATA / name, tmp_path / "wo", split=False), resident=True).model
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))

    def out(model, proj: str) -> torch.Tensor:
        return model.get_submodule("model.layers.1." + proj)(x)

    for proj, same, other in (("self_attn.qkv_proj", quantized, weight_only), ("mlp.gate_up_proj", weight_only, quantized)):
        assert torch.equal(out(mixed, proj), out(same, proj)), proj
        assert not torch.equal(out(mixed, proj), out(other, proj)), proj
