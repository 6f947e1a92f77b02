"""Multi-head latent attention's KV layout (models/mla.py): the pool stores one latent per token
and layer (kv_lora_rank + qk_rope_head_dim features), written and gathered once, and the KV
budget counts latents, on every rank alike."""

from __future__ import annotations

import json

import pytest
import torch

from batonlm.device.spec import _kv_bytes_per_token
from batonlm.model_runner.kv_pool import KVPool
from batonlm.model_runner.model_config import ModelConfig

# DeepSeek-V3's attention and sizes, as its config.json gives them (no head_dim: the rotary dim).
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 256, "n_shared_experts": 1,
    "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
}


@pytest.fixture
def v3_config(tmp_path) -> ModelConfig:
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V3))
    return ModelConfig.from_hf(tmp_path)


def test_deepseek_v3_stores_576_features_a_token_and_layer(v3_config):
    cfg = v3_config
    assert cfg.mla is not None and cfg.head_dim == 64  # rotary dim
    assert (cfg.kv_heads_per_rank(1), cfg.kv_head_dim) == (1, 512 + 64)
    per_token = _kv_bytes_per_token(cfg, torch.bfloat16)
    assert per_token == 61 * 576 * 2  # 70,272 bytes
    # What per-head keys and values would take: every head's [nope + rope] key and v value.
    full = 61 * 128 * ((128 + 64) + 128) * 2
    assert full == 4_997_120 and full / per_token > 71
    # Replicated on every rank: tensor parallelism splits heads, not the latent.
    assert _kv_bytes_per_token(cfg, torch.bfloat16, tp=8) == per_token
    # The softmax scale: 1/sqrt(192) times YaRN's mscale(40, 1.0) squared.
    mscale = 0.1 * 1.0 * torch.log(torch.tensor(40.0, dtype=torch.float64)).item() + 1.0
    assert cfg.attention_scale == pytest.approx(192**-0.5 * mscale * mscale, rel=1e-15)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn])
def test_a_latent_pool_writes_and_gathers_its_keys_once(cache_dtype):
    scales = None if cache_dtype == torch.float32 else [0.5, 0.25]
    pool = KVPool(64, 2, 1, 12, torch.float32, "cpu", cache_dtype, scales, latent=True)
    assert all(v is k for k, v in zip(pool.k, pool.v)) and pool.v_scale == pool.k_scale
    latent = torch.randn(5, 1, 12)
    slots = torch.tensor([3, 7, 9, 10, 11])
    pool.write(1, slots, latent, latent)
    keys, values = pool.gather(1, slots)
    assert keys is values
    into = pool.gather_buffers(5)
    assert into[0] is into[1]
    assert torch.equal(pool.gather(1, slots, into)[0], keys)
    if cache_dtype == torch.float32:
        assert torch.equal(keys, latent.transpose(0, 1))
    else:  # one rounding to e4m3 of latent / 0.25: within 2^-4 relative
        assert torch.allclose(keys, latent.transpose(0, 1), rtol=2**-4, atol=2**-9 * 0.25)
    assert KVPool.bytes_per_token(2, 1, 12, cache_dtype, latent=True) * 2 == KVPool.bytes_per_token(2, 1, 12, cache_dtype)


def test_latent_attention_on_transformers_code_is_refused_at_config_reading(tmp_path):
    """transformers' DeepSeek attention hands keys and values of different sizes (and another
    MLA architecture would too): one line naming what runs it, not a failed batch."""
    from batonlm.model_runner.model_config import ModelConfigError

    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V3))
    with pytest.raises(ModelConfigError, match=r"multi-head latent attention .*\(--model-impl auto\)"):
        ModelConfig.from_hf(tmp_path, "transformers")
    other = {**DEEPSEEK_V3, "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32"}
    (tmp_path / "config.json").write_text(json.dumps(other))
    with pytest.raises(ModelConfigError, match="DeepseekV32ForCausalLM uses multi-head latent attention.*"
                                               "runs DeepseekV2ForCausalLM and DeepseekV3ForCausalLM only"):
        ModelConfig.from_hf(tmp_path)  # (DeepSeek-V3.2's sparse attention: not the native V3's)
