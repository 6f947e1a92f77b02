"""What LoRA's device slots hold, counted before they are made: `slot_bytes` is the bytes
`LoRAWeights` allocates (dense and mixture-of-experts models, one rank and a tensor-parallel
one), and a GPU's KV budget leaves that room for them."""

from __future__ import annotations

import pytest
import torch

from batonlm.model_runner.lora import LoRAWeights, slot_bytes
from batonlm.model_runner.model_config import ModelConfig
from batonlm.model_runner.model_loader import tp_layout


def _held(w: LoRAWeights) -> int:
    return sum(t.numel() * t.element_size() for t in (*w.a.values(), *w.b_all.values()))


@pytest.mark.parametrize("family", ["stories", "qwen2_moe"])
@pytest.mark.parametrize("tp", [1, 2])
def test_the_count_is_what_the_slots_hold(request, family, tp):
    path = request.getfixturevalue("stories_path") if family == "stories" else request.getfixturevalue("tiny_models")[family]
    cfg = ModelConfig.from_hf(path)
    for rank in range(tp):
        shard = tp_layout(cfg, rank, tp)
        w = LoRAWeights(3, 8, cfg, shard, torch.bfloat16, torch.device("cpu"))
        assert slot_bytes(cfg, shard, 3, 8, torch.bfloat16) == _held(w) > 0
        assert w.mlp == (family == "stories")  # a mixture of experts: attention slots only


def test_a_gpus_kv_budget_leaves_room_for_the_slots(monkeypatch, stories_path):
    from batonlm.config import ServerArgs
    from batonlm.device import spec

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda _device: (3 * 2**30, 4 * 2**30))
    cfg = ModelConfig.from_hf(stories_path)
    args = ServerArgs(model=stories_path, max_running_requests=1 << 20, max_loaded_loras=8)
    plain = spec._kv_capacity(args, cfg, torch.bfloat16, "cuda", cfg.context_length)
    with_lora = spec._kv_capacity(args, cfg, torch.bfloat16, "cuda", cfg.context_length, lora_rank=64)
    per_token = spec._kv_bytes_per_token(cfg, torch.bfloat16)
    room = slot_bytes(cfg, tp_layout(cfg, 0, 1), 8, 64, torch.bfloat16)
    assert plain - with_lora in (room // per_token, room // per_token + 1)
