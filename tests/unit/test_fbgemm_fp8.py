"""FBGEMM FP8 checkpoints (`quant_method: fbgemm_fp8`, Meta's Llama 3.1 405B / Llama 4 FP8 layout;
written by tests/quant_fbgemm.py): the converted linears stay FP8 with their inputs quantized per
token, each token's amax capped at `activation_scale_ub`; `modules_to_not_convert` stay float.

Reference: transformers' Llama in float32 with the dequantized weights (codes * scale) and each
converted linear's input quantized as FBGEMM does (`fbgemm_activation`): what the checkpoint
means (transformers' own FBGEMM path needs CUDA). Bound: the same float32 math in another order,
1e-4 of the largest logit (tests/unit/test_quantized_checkpoints.py derives it); a quantized
activation at a rounding tie could round the other way in the other order, none does here (the
logits agree to the bound).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from quant_fbgemm import fbgemm_activation, write_fbgemm_fp8_checkpoint
from safetensors.torch import load_file

from batonlm.model_runner.model_config import ModelConfig
from batonlm.model_runner.quantization.linear import Fp8Linear

DATA = Path(__file__).resolve().parents[1] / "data" / "quantized"
NOT_CONVERTED = ("lm_head", "model.layers.0.self_attn")  # as Meta's releases keep attention in float
RELATIVE = 1e-4


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return load_file(str(DATA / "fp32-source" / "reference.safetensors"))["input_ids"].reshape(-1)


def _reference_logits(path: Path, deq: dict[str, torch.Tensor], ids: torch.Tensor, ub: float,
                      amaxes: list[torch.Tensor] | None = None) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(DATA / "fp32-source", dtype=torch.float32)
    tensors = {k: v.float() for k, v in load_file(str(path / "model.safetensors")).items()
               if not k.endswith(".weight_scale")}
    tensors.update(deq)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and all("rotary" in m for m in missing)

    def quantize_input(_module, args):
        if amaxes is not None:
            amaxes.append(args[0].abs().amax(dim=-1).flatten())
        return (fbgemm_activation(args[0], ub),)

    for name, module in model.named_modules():
        if f"{name}.weight" in deq:
            module.register_forward_pre_hook(quantize_input)
    with torch.no_grad():
        return model(ids[None]).logits[0]


def _batonlm_logits(path: Path, ids: torch.Tensor):
    from test_quantized_checkpoints import _prompt_logits, _runner

    runner = _runner(path)
    return runner, _prompt_logits(runner, ids)


def test_fbgemm_fp8_runs_its_weights_with_each_tokens_amax_capped(ids: torch.Tensor, tmp_path: Path) -> None:
    # The tokens' input amaxes without a cap: a cap at their median caps half of them.
    loose = tmp_path / "loose"
    deq = write_fbgemm_fp8_checkpoint(DATA / "fp32-source", loose, ub=1e30, not_convert=NOT_CONVERTED)
    amaxes: list[torch.Tensor] = []
    uncapped = _reference_logits(loose, deq, ids, 1e30, amaxes)
    ub = float(torch.cat(amaxes).median())
    out = tmp_path / "fbgemm"
    write_fbgemm_fp8_checkpoint(DATA / "fp32-source", out, ub=ub, not_convert=NOT_CONVERTED)  # the same weights
    quant = ModelConfig.from_hf(out).quantization
    assert quant is not None and quant.description == f"fbgemm_fp8 (per channel, dynamic activations, amax capped " \
                                                      f"at {ub:g})"
    want = _reference_logits(out, deq, ids, ub)
    runner, got = _batonlm_logits(out, ids)
    bound = RELATIVE * want.abs().max()
    assert (got - want).abs().max() <= bound
    assert (uncapped - want).abs().max() > 10 * bound  # the cap changes the logits; batonlm applies it
    # Converted: layer 1's projections and layer 0's MLP; not converted: layer 0's attention.
    model = runner.model
    fp8 = {n.removesuffix(".local") for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    assert fp8 == {"model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.down_proj",
                   "model.layers.1.self_attn.qkv_proj", "model.layers.1.self_attn.o_proj",
                   "model.layers.1.mlp.gate_up_proj", "model.layers.1.mlp.down_proj"}
    assert all(m.amax_ub == ub for m in model.modules() if isinstance(m, Fp8Linear))
    # Without a cap every token is quantized by its own amax: the loose checkpoint's logits.
    _, loose_logits = _batonlm_logits(loose, ids)
    assert (loose_logits - uncapped).abs().max() <= RELATIVE * uncapped.abs().max()


@pytest.mark.parametrize("ub", ["big", 0, -3.0, True, None])
def test_a_bad_activation_scale_ub_is_named(ub, tmp_path: Path) -> None:
    config = json.loads((DATA / "fp32-source" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fbgemm_fp8", "activation_scale_ub": ub}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"fbgemm_fp8 quantization_config.activation_scale_ub {ub!r} is not a "
                                         "positive number"):
        ModelConfig.from_hf(tmp_path)


def test_the_method_is_named_by_the_flag(tmp_path: Path) -> None:
    """`--quantization fbgemm_fp8` (vLLM's name) loads it; another method is refused naming both;
    the config's default cap is transformers' 1200."""
    config = json.loads((DATA / "fp32-source" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fbgemm_fp8"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    quant = ModelConfig.from_hf(tmp_path, quantization="fbgemm_fp8").quantization
    assert quant is not None and quant.act_amax_ub == 1200.0
    with pytest.raises(ValueError, match="--quantization fp8 does not match the checkpoint's quantization method "
                                         "fbgemm_fp8"):
        ModelConfig.from_hf(tmp_path, quantization="fp8")
