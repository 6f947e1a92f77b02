"""Tensor parallelism end to end (CPU, gloo): the same tokens at 2, 4 and 8 ranks as at one,
for stories260K and every tiny family, through the scheduler and both event loops, with the
ranks' divergence check on at every launch."""

import json
import random

import pytest
from helpers import (
    TEST_FAMILIES,
    SchedulerHarness,
    copy_tokenizer,
    hf_greedy,
    hf_model_class,
    random_prompts,
    randomize_biases_and_norms,
    tiny_config,
)

from batonlm.distributed.layout import TPConfigError
from batonlm.model_runner.model_config import ModelConfig
from batonlm.model_runner.model_loader import tp_layout

STORIES_TEXTS = [
    "Once upon a time",
    "Lily",
    "The dog ran to the park and",
    "One day, a little boy named Tim found a big red ball in the garden. He wanted to play with it,",
    "Sue had a cat.",
]


def _generate(path, prompts, max_new, *, overlap=True, params=None, arrivals=None, **args):
    h = SchedulerHarness(path, **args)
    try:
        for i, (ids, n) in enumerate(zip(prompts, max_new)):
            h.submit(f"r{i}", ids, {"temperature": 0.0, **(params or {}), "max_new_tokens": n},
                     at=arrivals[i] if arrivals else 0)
        records = h.run(overlap)
        h.assert_all_free()
        return [records[f"r{i}"].token_ids for i in range(len(prompts))]
    finally:
        h.close()


@pytest.fixture(scope="module")
def stories_case(stories_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stories_path)
    prompts = [tok(t).input_ids for t in STORIES_TEXTS] + random_prompts(3, random.Random(5), lo=1, hi=120)
    max_new = [60, 90, 40, 70, 50, 30, 45, 64]
    arrivals = [0, 0, 2, 5, 5, 9, 14, 20]  # prefills land beside running decodes
    return prompts, max_new, arrivals, _generate(stories_path, prompts, max_new, arrivals=arrivals)


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4 ranks: the uneven-split test
def test_stories260k_gives_the_same_tokens_at_any_rank_count(stories_path, stories_case, tp):
    """(8 ranks, where its 4 KV heads are replicated and its 172 MLP features split 22/21, give
    the same tokens too; the uneven-split test below covers both at 4 ranks, faster.)"""
    prompts, max_new, arrivals, expected = stories_case
    got = _generate(stories_path, prompts, max_new, arrivals=arrivals, tp_size=tp, debug_tp_check_every=1)
    assert got == expected
    if tp == 2:  # the normal loop too
        assert _generate(stories_path, prompts, max_new, overlap=False, arrivals=arrivals, tp_size=2,
                         debug_tp_check_every=1) == expected


def test_seeded_sampling_is_the_same_at_two_ranks(stories_path, stories_case):
    prompts = stories_case[0][:4]
    params = {"temperature": 0.9, "top_p": 0.95, "seed": 11}
    one = _generate(stories_path, prompts, [40] * 4, params=params)
    assert _generate(stories_path, prompts, [40] * 4, params=params, tp_size=2, debug_tp_check_every=1) == one


# Every family, at 2 and 4 ranks in turn (the uneven-split test below runs Llama at both).
@pytest.mark.parametrize(("family", "tp"), [(f, 4 if i % 2 else 2) for i, f in enumerate(TEST_FAMILIES)])
def test_tiny_families_match_transformers_under_tensor_parallelism(tiny_models, family, tp):
    """4 heads and 2 KV heads: at 4 ranks each KV head is on two ranks. Qwen2: q/k/v biases
    split with their rows; Qwen3: q/k norms per head; Mistral: a sliding window."""
    path = tiny_models[family]
    rng = random.Random(len(family) * tp)
    prompts = random_prompts(6, rng, lo=1, hi=150)
    max_new = [rng.randint(8, 24) for _ in prompts]
    got = _generate(path, prompts, max_new, arrivals=[0, 0, 1, 3, 3, 6], tp_size=tp, debug_tp_check_every=1)
    assert got == hf_greedy(path, prompts, max_new)


def test_uneven_mlp_split_padded_vocabulary_and_one_kv_head(tmp_path):
    """An intermediate size of 90 over 4 ranks (23, 23, 22, 22), a vocabulary of 515 padded to
    516 (the last rank's last row is padding), one KV head on every rank; untied LM head with
    biases on q/k/v and o."""
    import torch

    cfg = tiny_config("llama")
    cfg.intermediate_size, cfg.vocab_size, cfg.num_key_value_heads = 90, 515, 1
    cfg.tie_word_embeddings, cfg.attention_bias = False, True
    torch.manual_seed(7)
    model = hf_model_class("llama")(cfg).to(torch.float32)
    randomize_biases_and_norms(model)  # o_proj's bias: added once, not once per rank
    model.save_pretrained(tmp_path, safe_serialization=True)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "bos_token_id": 1}))
    copy_tokenizer(tmp_path)
    layouts = [tp_layout(ModelConfig.from_hf(tmp_path), r, 4) for r in range(4)]
    assert [s.mlp_rows()[1] for s in layouts] == [23, 23, 22, 22]
    assert layouts[3].vocab_rows_in_checkpoint() == (387, 128)
    rng = random.Random(3)
    prompts = random_prompts(5, rng, lo=1, hi=100)
    max_new = [16] * 5
    want = hf_greedy(str(tmp_path), prompts, max_new)
    for tp in (2, 4):
        assert _generate(str(tmp_path), prompts, max_new, tp_size=tp, debug_tp_check_every=1) == want


def test_an_impossible_split_is_a_clear_error(stories_path):
    with pytest.raises(TPConfigError, match="cannot split 8 attention heads over 3 ranks"):
        SchedulerHarness(stories_path, tp_size=3)
