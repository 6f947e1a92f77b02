"""Tensor-parallel layout: which part of each weight a rank holds, and that loading reads only it."""

import math

import pytest
import torch

from batonlm.distributed.layout import TPConfigError, TPLayout, check_split
from batonlm.model_runner.model_config import ModelConfig
from batonlm.model_runner.model_loader import load_model, tp_layout


def _layouts(size, heads=8, kv=4, head_dim=8, inter=172, vocab=512):
    return [TPLayout(r, size, heads, kv, head_dim, inter, vocab) for r in range(size)]


@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_the_ranks_split_every_dimension_without_gaps_or_overlaps(size):
    layouts = _layouts(size)
    for rows in (lambda s: s.q_rows(), lambda s: s.mlp_rows(), lambda s: s.vocab_rows()):
        spans = [rows(s) for s in layouts]
        assert spans[0][0] == 0
        assert all(a[0] + a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert sum(s.mlp_rows()[1] for s in layouts) == 172
    assert sum(s.q_rows()[1] for s in layouts) == 8 * 8
    assert max(s.mlp_rows()[1] for s in layouts) - min(s.mlp_rows()[1] for s in layouts) <= 1


def test_each_rank_has_the_kv_heads_its_query_heads_use():
    # GQA: query head h uses KV head h // (heads / kv_heads).
    for heads, kv, size in [(8, 4, 2), (8, 4, 4), (8, 4, 8), (8, 2, 8), (4, 1, 4), (4, 2, 4)]:
        group = heads // kv
        for s in _layouts(size, heads=heads, kv=kv):
            first_q = s.rank * s.heads
            needed = sorted({h // group for h in range(first_q, first_q + s.heads)})
            assert needed == list(range(s.first_kv_head, s.first_kv_head + s.kv_heads)), (heads, kv, size, s.rank)
    assert _layouts(8)[5].kv_replicas == 2 and _layouts(8)[5].kv_heads == 1


def test_the_vocabulary_is_padded_to_a_multiple_of_the_ranks():
    layouts = _layouts(4, vocab=515)
    assert layouts[0].padded_vocab == 516
    assert [s.vocab_rows() for s in layouts] == [(0, 129), (129, 129), (258, 129), (387, 129)]
    assert layouts[3].vocab_rows_in_checkpoint() == (387, 128)  # its last row is padding


@pytest.mark.parametrize(("size", "heads", "kv", "message"), [
    (3, 8, 4, "cannot split 8 attention heads over 3 ranks"),
    (2, 6, 3, "cannot split 3 KV heads over 2 ranks"),
])
def test_impossible_splits_are_clear_errors(size, heads, kv, message):
    with pytest.raises(TPConfigError, match=message):
        check_split(size, heads, kv, 96)


def test_kv_heads_that_do_not_divide_the_ranks_are_a_clear_error():
    with pytest.raises(TPConfigError, match="multiple of num_key_value_heads"):
        check_split(8, 8, 3, 96)


@pytest.mark.parametrize("size", [2, 4, 8])
def test_each_rank_reads_only_its_shard_and_the_shards_make_the_model(stories_path, size):
    cfg = ModelConfig.from_hf(stories_path)
    full, full_stats = load_model(cfg, torch.float32, "cpu")
    assert full_stats.bytes_read == full_stats.checkpoint_bytes
    ranks = [load_model(cfg, torch.float32, "cpu", shard=tp_layout(cfg, r, size)) for r in range(size)]
    norm_bytes = sum(p.numel() * 4 for n, p in full.named_parameters() if "norm" in n)
    kv_bytes = 2 * cfg.num_kv_heads * cfg.head_dim * cfg.hidden_size * 4 * cfg.num_layers  # k_proj + v_proj
    for model, stats in ranks:
        # Exactly the rank's own parameters (the vocabulary divides evenly here: no padding).
        assert stats.bytes_read == sum(p.numel() * 4 for p in model.parameters())
        # About 1/size of the checkpoint: only the norms (and K/V beyond the KV head count) repeat.
        kv_extra = kv_bytes * (1 / cfg.num_kv_heads - 1 / size) if size > cfg.num_kv_heads else 0
        ideal = (stats.checkpoint_bytes - norm_bytes) / size + norm_bytes + kv_extra
        # An uneven MLP split: at most one intermediate row more or less of gate, up and down per layer.
        uneven = 3 * cfg.hidden_size * 4 * cfg.num_layers
        assert abs(stats.bytes_read - ideal) <= uneven, (stats.bytes_read, ideal)

    def joined(name: str, dim: int) -> torch.Tensor:
        return torch.cat([dict(m.named_parameters())[name] for m, _ in ranks], dim=dim)

    layer = "model.layers.2."
    params = dict(full.named_parameters())
    assert torch.equal(joined("model.embed_tokens.weight", 0), params["model.embed_tokens.weight"])
    assert torch.equal(joined(layer + "self_attn.o_proj.weight", 1), params[layer + "self_attn.o_proj.weight"])
    assert torch.equal(joined(layer + "mlp.down_proj.weight", 1), params[layer + "mlp.down_proj.weight"])
    gate = torch.cat([dict(m.named_parameters())[layer + "mlp.gate_up_proj.weight"][: m.shard.mlp_rows()[1]]
                      for m, _ in ranks])
    assert torch.equal(gate, params[layer + "mlp.gate_up_proj.weight"][: cfg.intermediate_size])
    q_rows = cfg.num_heads * cfg.head_dim // size
    q = torch.cat([dict(m.named_parameters())[layer + "self_attn.qkv_proj.weight"][:q_rows] for m, _ in ranks])
    assert torch.equal(q, params[layer + "self_attn.qkv_proj.weight"][: cfg.num_heads * cfg.head_dim])
    # K of each rank: the KV head(s) its query heads use.
    k_full = params[layer + "self_attn.qkv_proj.weight"][cfg.num_heads * cfg.head_dim :][: cfg.num_kv_heads * cfg.head_dim]
    for m, _ in ranks:
        start, count = m.shard.kv_rows()
        k = dict(m.named_parameters())[layer + "self_attn.qkv_proj.weight"][q_rows : q_rows + count]
        assert torch.equal(k, k_full[start : start + count])


@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_gpu_memory_sizing_counts_a_ranks_share_of_the_weights(stories_path, size):
    from batonlm.model_runner.weight_size import weight_bytes

    cfg = ModelConfig.from_hf(stories_path)
    counted = weight_bytes(cfg, torch.float32, size, device="cpu")
    model, _ = load_model(cfg, torch.float32, "cpu", shard=tp_layout(cfg, 0, size))
    assert counted == 4 * sum(p.numel() for p in model.parameters())  # rank 0 holds the larger share


def test_gpu_memory_sizing_counts_every_expert_and_latent(tiny_models):
    """One rank of every family holds its checkpoint's parameters (the tied head once, every
    expert, MLA's latent projections): the KV budget is what is left after all of them. Split
    two ways, each rank holds at least half, and less than all."""
    from safetensors import safe_open

    from batonlm.model_runner.weight_loader import checkpoint_files
    from batonlm.model_runner.weight_size import weight_bytes

    for family, path in tiny_models.items():
        cfg = ModelConfig.from_hf(path)
        stored = 0
        for f in checkpoint_files(path):
            with safe_open(f, "pt") as ckpt:
                stored += sum(math.prod(ckpt.get_slice(k).get_shape()) for k in ckpt.keys())
        assert weight_bytes(cfg, torch.bfloat16, device="cpu") == 2 * stored, family
        half = weight_bytes(cfg, torch.bfloat16, 2, device="cpu")
        assert stored <= half < 2 * stored, family
