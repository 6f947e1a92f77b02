"""YaRN rotary scaling (Qwen2.5/Qwen3 long context, DeepSeek) equals transformers': the inverse
frequencies bit for bit and the factor cos/sin are multiplied by."""

from __future__ import annotations

import json

import pytest
import torch

from batonlm.model_runner.layers import rope_attention_factor, rope_inv_freq
from batonlm.model_runner.model_config import ModelConfig

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 256,
         "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 32768, "rope_theta": 1000000.0}


@pytest.mark.parametrize("scaling", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192},  # Qwen2.5's long context
    {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
     "mscale": 0.707, "mscale_all_dim": 0.707},  # DeepSeek-V2's
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 2048, "attention_factor": 1.3,
     "beta_fast": 16, "beta_slow": 2, "truncate": False},
])
def test_yarn_matches_transformers(tmp_path, scaling):
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "rope_scaling": scaling}))
    cfg = ModelConfig.from_hf(tmp_path)
    assert cfg.rope.type == "yarn"
    want_inv, want_factor = ROPE_INIT_FUNCTIONS["yarn"](AutoConfig.from_pretrained(tmp_path))
    assert torch.equal(rope_inv_freq(cfg.rope, cfg.head_dim), want_inv)
    assert rope_attention_factor(cfg.rope) == want_factor
