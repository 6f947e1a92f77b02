import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from batonlm.model_runner.model_config import ModelConfig, ModelConfigError
from batonlm.model_runner.model_loader import load_model
from batonlm.model_runner.weight_loader import WeightLoadError
from batonlm.registries import MODEL_ARCHITECTURES


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_model_config_reads_stories260k(stories_path):
    cfg = ModelConfig.from_hf(stories_path)
    assert (cfg.architecture, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        "LlamaForCausalLM", 5, 8, 4, 8)
    assert cfg.tie_word_embeddings and cfg.context_length == 512
    # generation_config.json lists both stop ids; config.json only one.
    assert cfg.eos_token_ids == (2, 1)


def test_model_config_reads_family_options(tiny_models):
    llama = ModelConfig.from_hf(tiny_models["llama"])
    assert llama.head_dim == 24 and llama.rope.type == "llama3" and llama.rope.theta == 500000.0
    assert ModelConfig.from_hf(tiny_models["mistral"]).sliding_windows == (24, 24)
    assert ModelConfig.from_hf(tiny_models["qwen3"]).sliding_windows == (None, None)


def test_model_config_errors(tmp_path, stories_path):
    with pytest.raises(ModelConfigError, match="not a directory"):
        ModelConfig.from_hf(tmp_path / "nope")
    with pytest.raises(ModelConfigError, match="no config.json"):
        ModelConfig.from_hf(tmp_path)
    d = _copy(stories_path, tmp_path / "m")
    raw = json.loads((d / "config.json").read_text())
    raw["rope_scaling"] = {"rope_type": "dynamic", "factor": 4.0}
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelConfigError, match="'dynamic' is not supported"):
        ModelConfig.from_hf(d)


def test_an_architecture_batonlm_has_no_module_for_is_named_at_config_reading(tmp_path):
    """Before any other field is read (GPT-2's config has no hidden_size), the error names the
    architecture and the native ones; with `auto` GPT-2 goes to transformers, whose config
    maps its field names (n_embd is hidden_size)."""
    gpt2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4,
            "vocab_size": 512}
    (tmp_path / "config.json").write_text(json.dumps(gpt2))
    with pytest.raises(ModelConfigError) as err:
        ModelConfig.from_hf(tmp_path, "native")
    native = ", ".join(MODEL_ARCHITECTURES.names())
    assert str(err.value).endswith(f"model architecture 'GPT2LMHeadModel' has no native module (native: {native}); "
                                   "--model-impl auto or transformers runs transformers' modeling code")
    cfg = ModelConfig.from_hf(tmp_path)
    assert (cfg.impl, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.head_dim) == ("transformers", 64, 2, 4, 16)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(ModelConfigError, match="'architectures' is missing or empty: the model's class cannot be known"):
        ModelConfig.from_hf(tmp_path)


def test_strict_loading_names_missing_unexpected_and_misshapen_tensors(tmp_path, stories_path):
    d = _copy(stories_path, tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.3.mlp.up_proj.weight"]
    tensors["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
    tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(16, 64)
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(WeightLoadError) as err:
        load_model(ModelConfig.from_hf(d), torch.float32, "cpu")[0]
    msg = str(err.value)
    assert "missing tensor(s): model.layers.1.self_attn.k_proj.weight; model.layers.3.mlp.up_proj.weight" in msg
    assert "unexpected tensor(s): model.layers.0.self_attn.extra.weight" in msg
    assert "model.layers.1.self_attn.k_proj.weight: checkpoint (16, 64), model expects (32, 64)" in msg


def test_sharded_checkpoint_loads_like_the_single_file(tmp_path, stories_path):
    d = _copy(stories_path, tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, d / fname)
        weight_map.update({k: fname for k in keys})
    (d / "model.safetensors").unlink()
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    sharded = load_model(ModelConfig.from_hf(d), torch.float32, "cpu")[0]
    single = load_model(ModelConfig.from_hf(stories_path), torch.float32, "cpu")[0]
    for (n1, p1), (n2, p2) in zip(sharded.state_dict().items(), single.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_dtypes_load(stories_path, dtype):
    model = load_model(ModelConfig.from_hf(stories_path), dtype, "cpu")[0]
    assert {p.dtype for p in model.parameters()} == {dtype}
    ref = load_file(f"{stories_path}/model.safetensors")["model.norm.weight"]
    assert torch.equal(model.model.norm.weight, ref.to(dtype))


def test_large_checkpoints_show_a_progress_bar(stories_path, capsys, monkeypatch):
    from batonlm.model_runner import weight_loader

    load_model(ModelConfig.from_hf(stories_path), torch.float32, "cpu")[0]
    assert "Loading weights" not in capsys.readouterr().err  # 1 MB: below the threshold
    monkeypatch.setattr(weight_loader, "PROGRESS_BAR_BYTES", 1)
    load_model(ModelConfig.from_hf(stories_path), torch.float32, "cpu")[0]
    assert "Loading weights: 100%" in capsys.readouterr().err


def test_moe_families_read_their_expert_layout(tiny_models):
    """Qwen3-MoE: a dense first layer (`mlp_only_layers`), top-3 of 8 renormalised, rounded to
    the model dtype; Mixtral: every layer sparse, weights kept in float32."""
    from batonlm.model_runner.moe import SparseMoE

    qwen = MODEL_ARCHITECTURES["Qwen3MoeForCausalLM"].options(ModelConfig.from_hf(tiny_models["qwen3_moe"]).raw)
    assert qwen.moe_layers == frozenset({1}) and qwen.qk_norm
    assert (qwen.moe.num_experts, qwen.moe.top_k, qwen.moe.intermediate_size) == (8, 3, 32)
    assert qwen.moe.renormalize and not qwen.moe.weights_in_fp32
    cfg = ModelConfig.from_hf(tiny_models["mixtral"])
    mixtral = MODEL_ARCHITECTURES["MixtralForCausalLM"].options(cfg.raw)
    assert mixtral.moe_layers == frozenset({0, 1}) and mixtral.moe.renormalize and mixtral.moe.weights_in_fp32
    model, stats = load_model(cfg, torch.float32, "cpu")
    layer = model.model.layers[0].mlp
    assert isinstance(layer, SparseMoE) and layer.experts.w13.shape == (4, 2 * 48, 64)
    # Expert 2's up projection (Mixtral's w3) is the second half of its fused rows.
    ckpt = load_file(f"{tiny_models['mixtral']}/model.safetensors")
    assert torch.equal(layer.experts.w13[2, 48:], ckpt["model.layers.0.block_sparse_moe.experts.2.w3.weight"])
    assert torch.equal(layer.experts.w2[3], ckpt["model.layers.0.block_sparse_moe.experts.3.w2.weight"])
    assert stats.bytes_read == stats.checkpoint_bytes


def test_a_moe_checkpoint_missing_an_expert_is_named(tmp_path, tiny_models):
    d = _copy(tiny_models["mixtral"], tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(WeightLoadError, match=r"1 missing tensor\(s\): model\.layers\.1\.block_sparse_moe\.experts\.3\.w2\.weight"):
        load_model(ModelConfig.from_hf(d), torch.float32, "cpu")
    raw = json.loads((d / "config.json").read_text())
    del raw["num_experts_per_tok"]
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelConfigError, match="needs 'num_experts_per_tok'"):
        load_model(ModelConfig.from_hf(d), torch.float32, "cpu")


def test_moe_experts_split_over_the_mlp_ranks(tiny_models):
    """Each rank holds every expert's slice of intermediate features (rows of gate/up, columns
    of down), and the slices of all ranks are the checkpoint's. Three ranks of the MLP (DP
    attention's split, which tensor parallelism shares): 32 features as 11, 11, 10."""
    from batonlm.distributed.group import TPGroup

    cfg = ModelConfig.from_hf(tiny_models["qwen3_moe"])
    ckpt = load_file(f"{tiny_models['qwen3_moe']}/model.safetensors")
    ups, downs = [], []
    for rank in range(3):
        model, stats = load_model(cfg, torch.float32, "cpu", mlp_group=TPGroup(rank, 3))
        experts = model.model.layers[1].mlp.experts
        count = experts.rows[1]
        assert count == (11, 11, 10)[rank] and experts.w13.shape == (8, 2 * count, 64)
        ups.append(experts.w13[5, count:])
        downs.append(experts.w2[5])
        assert stats.bytes_read < stats.checkpoint_bytes
    assert torch.equal(torch.cat(ups), ckpt["model.layers.1.mlp.experts.5.up_proj.weight"])
    assert torch.equal(torch.cat(downs, dim=1), ckpt["model.layers.1.mlp.experts.5.down_proj.weight"])


def test_a_shared_expert_is_sliced_like_the_experts(tiny_models):
    """Qwen2-MoE's shared expert (48 features, its own size) over 3 MLP ranks: 16 each, the
    slices of all ranks the checkpoint's; its gate replicated."""
    from batonlm.distributed.group import TPGroup

    cfg = ModelConfig.from_hf(tiny_models["qwen2_moe"])
    ckpt = load_file(f"{tiny_models['qwen2_moe']}/model.safetensors")
    gates, downs = [], []
    for rank in range(3):
        model, _ = load_model(cfg, torch.float32, "cpu", mlp_group=TPGroup(rank, 3))
        moe = model.model.layers[1].mlp
        gates.append(moe.shared_expert.gate_up_proj.weight[:16])
        downs.append(moe.shared_expert.down_proj.weight)
        assert torch.equal(moe.shared_expert_gate.weight, ckpt["model.layers.1.mlp.shared_expert_gate.weight"])
    assert torch.equal(torch.cat(gates), ckpt["model.layers.1.mlp.shared_expert.gate_proj.weight"])
    assert torch.equal(torch.cat(downs, dim=1), ckpt["model.layers.1.mlp.shared_expert.down_proj.weight"])
