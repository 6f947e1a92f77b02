"""gpt-oss's MXFP4 experts (`quant_method: mxfp4`): the test writer's layout against transformers'
own reading of it, and batonlm's dequantizing view against both."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import build_tiny_model, copy_tokenizer
from quant_gpt_oss import write_gpt_oss_mxfp4_checkpoint
from safetensors.torch import load_file, save_file

from batonlm.model_runner.model_config import ModelConfig
from batonlm.model_runner.quantization.config import QuantizationError
from batonlm.model_runner.weight_loader import checkpoint_files, open_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    build_tiny_model("gpt_oss", root / "float")
    copy_tokenizer(root / "float")
    return root / "mxfp4", write_gpt_oss_mxfp4_checkpoint(root / "float", root / "mxfp4")


def test_the_experts_read_as_transformers_dequantizes_them(checkpoint) -> None:
    """transformers' `Mxfp4Config(dequantize=True)` (its reference unpacking of OpenAI's layout)
    gives the writer's dequantized experts bit for bit, and so does batonlm's view, which shows
    each blocks / scales pair as transformers' [E, K, N] parameter and nothing of the pair."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    path, deq = checkpoint
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True))
    params = dict(hf.named_parameters())
    cfg = ModelConfig.from_hf(path)
    assert cfg.quantization is not None and cfg.quantization.description == "mxfp4 (gpt-oss's MoE experts)"
    with open_checkpoint(checkpoint_files(path), cfg.quantization) as ckpt:
        names = set(ckpt.names())
        assert set(deq) <= names and not any(n.endswith(("_blocks", "_scales")) for n in names)
        for name, want in deq.items():
            assert torch.equal(params[name].detach(), want), name
            assert ckpt.shape(name) == tuple(want.shape) and torch.equal(ckpt.read(name), want), name
        assert torch.equal(ckpt.read("lm_head.weight"), params["lm_head.weight"].detach())  # float tensors as stored


def test_blocks_without_their_scales_are_named(checkpoint, tmp_path) -> None:
    path, _ = checkpoint
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    for f in path.iterdir():
        if f.name != "model.safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    cfg = ModelConfig.from_hf(tmp_path)
    with pytest.raises(QuantizationError, match=r"model\.layers\.1\.mlp\.experts\.down_proj_blocks has no "
                                                r"model\.layers\.1\.mlp\.experts\.down_proj_scales"):
        with open_checkpoint(checkpoint_files(tmp_path), cfg.quantization):
            pass
