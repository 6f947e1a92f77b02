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


def test_longrope_tables_are_transformers_short_and_long_rotations(tmp_path):
    """Phi-3's LongRoPE (rotating 12 of 16 features): the first table is transformers' rotation
    of a sequence within the original context (short factors), the second, read by a sequence
    longer than it at every position, its rotation past it (long factors); both times the same
    temperature."""
    from transformers import AutoConfig
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from batonlm.model_runner.layers import RotaryEmbedding

    short, long = [1.0, 1.1, 1.3, 1.7, 2.5, 4.0], [1.0, 1.9, 3.4, 6.2, 11.0, 19.0]
    raw = {**LLAMA, "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 64, "head_dim": 16,
           "partial_rotary_factor": 0.75, "max_position_embeddings": 1024, "original_max_position_embeddings": 32,
           "rope_theta": 10000.0, "rope_scaling": {"type": "longrope", "short_factor": short, "long_factor": long}}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = ModelConfig.from_hf(tmp_path)
    assert (cfg.rope.type, cfg.rotary_dim, cfg.rope.factor, cfg.long_rope_from) == ("longrope", 12, 32.0, 32)
    ours = RotaryEmbedding(cfg.rope, cfg.rotary_dim, cfg.max_position_embeddings)
    assert ours.cos.shape == (2048, 12)
    x = torch.zeros(1, 1, 16)
    within = torch.arange(32)
    cos, sin = Phi3RotaryEmbedding(AutoConfig.from_pretrained(tmp_path))(x, within[None])
    assert torch.equal(ours.cos[within], cos[0]) and torch.equal(ours.sin[within], sin[0])
    longer = torch.arange(90)  # a sequence of 90: every position by the long factors
    cos, sin = Phi3RotaryEmbedding(AutoConfig.from_pretrained(tmp_path))(x, longer[None])
    assert torch.equal(ours.cos[1024 + longer], cos[0]) and torch.equal(ours.sin[1024 + longer], sin[0])
    assert not torch.allclose(ours.cos[longer], ours.cos[1024 + longer], atol=1e-3)
