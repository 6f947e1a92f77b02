"""Greedy outputs equal transformers' greedy outputs token for token (fp32, same weights)."""

import random
import zlib

import pytest
from helpers import (
    TEST_FAMILIES,
    SchedulerHarness,
    build_tiny_model,
    copy_tokenizer,
    family_with,
    hf_greedy,
    random_prompts,
    tiny_raw,
)

NUM_PROMPTS = 9


def _requests(seed: int):
    rng = random.Random(seed)
    prompts = random_prompts(NUM_PROMPTS, rng, lo=1, hi=200)
    max_new = [rng.randint(8, 24) for _ in prompts]
    return prompts, max_new


def _check(harness: SchedulerHarness, prompts, max_new, expected, arrivals, eos=(2,)) -> int:
    """Run and compare; returns how many requests stopped on EOS."""
    for i, (ids, n, at) in enumerate(zip(prompts, max_new, arrivals)):
        harness.submit(f"r{i}", ids, {"temperature": 0.0, "max_new_tokens": n}, at=at)
    records = harness.run(overlap=True)
    for i, want in enumerate(expected):
        got = records[f"r{i}"]
        assert got.token_ids == want, f"prompt {i} (len {len(prompts[i])}): got {got.token_ids}, want {want}"
        stopped = want[-1] in eos and len(want) <= max_new[i]
        assert got.finish_reason == ("stop" if stopped else "length")
    harness.assert_all_free()
    return sum(r.finish_reason == "stop" for r in records.values())


@pytest.mark.parametrize("family", TEST_FAMILIES)
def test_tiny_family_matches_transformers(tiny_models, family):
    path = tiny_models[family]
    prompts, max_new = _requests(seed=zlib.crc32(family.encode()))  # its own prompts, stable across runs
    expected = hf_greedy(path, prompts, max_new)
    h = SchedulerHarness(path)
    try:
        # All at once: one prefill batch of prompts of 1..200 tokens, then batched decodes.
        _check(h, prompts, max_new, expected, arrivals=[0] * len(prompts))
        # One at a time while others decode: prefills interleave with running decodes.
        _check(h, prompts, max_new, expected, arrivals=[3 * i for i in range(len(prompts))])
    finally:
        h.close()


def test_tiny_family_matches_transformers_mixed_batches(tiny_models):
    """With mixed batches, prefills and decodes of different lengths share one forward (and a
    sliding window)."""
    path = tiny_models[family_with("sliding_window")]
    prompts, max_new = _requests(seed=7)
    expected = hf_greedy(path, prompts, max_new)
    h = SchedulerHarness(path, enable_mixed_batch=True)
    try:
        _check(h, prompts, max_new, expected, arrivals=[2 * i for i in range(len(prompts))])
    finally:
        h.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_longrope_past_the_original_context_is_transformers_rotation(tmp_path, overlap):
    """Phi-3's LongRoPE with an original context of 32. transformers rotates a sequence longer
    than it by the long factors at every position, re-encoding the whole sequence when one grows
    past it. So does batonlm: prompts longer than 32 (cut into chunks of 16, sharing a cached
    prefix) run under the long rotation from the start; prompts within it generate past it and
    are recomputed there. Both loops, n-gram drafts stopping short of the switch."""
    from batonlm.scheduler.speculative import SpecConfig

    scaling = {**tiny_raw("phi3")["rope_scaling"], "original_max_position_embeddings": 32}
    build_tiny_model("phi3", tmp_path, original_max_position_embeddings=32, rope_scaling=scaling)
    copy_tokenizer(tmp_path)
    rng = random.Random(32)
    short = random_prompts(4, rng, lo=4, hi=30)
    long = random_prompts(2, rng, lo=40, hi=90)
    prompts = [*short, *long, long[0][:36] + short[0][:5]]  # the last shares a cached long prefix
    max_new = [max(8, 40 - len(p)) + rng.randint(0, 8) for p in prompts]  # the short ones cross 32
    expected = hf_greedy(str(tmp_path), prompts, max_new)
    h = SchedulerHarness(str(tmp_path), chunked_prefill_size=16)
    h.reconfigure(speculative=SpecConfig(num_draft_tokens=3, cost_ratio=0.0, ngram_min=1))
    try:
        for i, (ids, n) in enumerate(zip(prompts, max_new)):
            h.submit(f"r{i}", ids, {"temperature": 0.0, "max_new_tokens": n}, at=i if i < len(prompts) - 1 else 12)
        records = h.run(overlap=overlap)
        for i, want in enumerate(expected):
            assert records[f"r{i}"].token_ids == want, f"prompt {i} (len {len(prompts[i])})"
        h.assert_all_free()
        assert h.sched.planner.num_rotation_switches == len(short)  # each crossing recomputed once
    finally:
        h.close()


def test_stories260k_matches_transformers(stories_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stories_path)
    texts = [
        "Once upon a time",
        "Lily",
        "The dog ran to the park and",
        "One day, a little boy named Tim found a big red ball in the garden. He wanted to play with it,"
        " but his mom said it was time for lunch. Tim was sad, but he went inside. After lunch,",
        "Sue had a cat.",
        "The sun was hot. Ben and Anna went to the beach with their mom and dad. They made a big sand castle"
        " with a flag on top. Then a wave came and",
        "Once upon a time there was a tiny frog who lived in a pond. Every day he would jump from leaf to leaf"
        " and sing a happy song. The other animals liked his song very much. One morning the frog woke up and"
        " found that his voice was gone. He was very sad and did not know what to do. He went to the wise old"
        " owl and asked for help. The owl said",
        "Mom said",
    ]
    prompts = [tok(t).input_ids for t in texts]
    assert max(len(p) for p in prompts) > 80
    max_new = [40, 300, 120, 200, 250, 200, 150, 300]
    expected = hf_greedy(stories_path, prompts, max_new)
    h = SchedulerHarness(stories_path)
    try:
        stops = _check(h, prompts, max_new, expected, arrivals=[0] * len(prompts), eos=(2, 1))
        assert stops >= 2, "the comparison should include stories that end on an EOS id"
        _check(h, prompts, max_new, expected, arrivals=[4 * i for i in range(len(prompts))], eos=(2, 1))
    finally:
        h.close()


def test_stories260k_in_bfloat16_matches_transformers_in_bfloat16(stories_path):
    """`--dtype bfloat16` on the CPU (eager: `--compile auto` keeps 16-bit models eager): every
    op rounds as transformers' bfloat16 run does, so the greedy tokens are its tokens."""
    import random

    import torch

    rng = random.Random(0)
    prompts = [[1] + [rng.randrange(3, 500) for _ in range(rng.randint(4, 40))] for _ in range(4)]
    expected = hf_greedy(stories_path, prompts, [24] * 4, dtype=torch.bfloat16)
    h = SchedulerHarness(stories_path, dtype="bfloat16", max_running_requests=4)
    try:
        assert h.info.dtype == "bfloat16"  # the engine really runs in bfloat16
        for i, ids in enumerate(prompts):
            h.submit(f"r{i}", ids, {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}, at=i)
        got = h.run(overlap=True)
    finally:
        h.close()
    assert [got[f"r{i}"].token_ids for i in range(4)] == expected


def test_a_gemma3_multimodal_checkpoint_serves_its_text_decoder(tmp_path):
    """Gemma 3 4B and up are saved as Gemma3ForConditionalGeneration: a vision tower beside the
    text decoder, whose config lists only what differs from transformers' defaults. Text in,
    text out, batonlm's Gemma 3 runs the decoder (found under either layout's prefix, the
    vision tower not read) and answers as transformers' multimodal class does."""
    import json

    import torch
    from helpers import copy_tokenizer, randomize_biases_and_norms, tiny_raw
    from safetensors.torch import load_file, save_file
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from batonlm.model_runner.model_config import ModelConfig

    text = {k: v for k, v in tiny_raw("gemma3_text").items() if k != "architectures"}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 28, "patch_size": 14}
    torch.manual_seed(5)
    model = Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision,
                                                        mm_tokens_per_image=4)).to(torch.float32)
    randomize_biases_and_norms(model)
    saved = tmp_path / "transformers-layout"
    model.save_pretrained(saved)
    copy_tokenizer(saved)
    (saved / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "bos_token_id": 1}))
    # The hub's layout (language_model.model.*, vision_tower.*), as Google's checkpoints are.
    hub = tmp_path / "hub-layout"
    hub.mkdir()
    for f in saved.iterdir():
        if f.suffix != ".safetensors":
            (hub / f.name).write_bytes(f.read_bytes())
    renamed = {k.replace("model.language_model.", "language_model.model.").replace("model.vision_tower.", "vision_tower.")
               .replace("model.multi_modal_projector.", "multi_modal_projector."): v
               for k, v in load_file(saved / "model.safetensors").items()}
    assert any(k.startswith("vision_tower.") for k in renamed)
    save_file(renamed, hub / "model.safetensors", metadata={"format": "pt"})

    cfg = ModelConfig.from_hf(saved)
    assert (cfg.architecture, cfg.impl, cfg.text_decoder_of) == ("Gemma3ForCausalLM", "native",
                                                                  "Gemma3ForConditionalGeneration")
    prompts, max_new = _requests(seed=11)
    want = []
    with torch.no_grad():
        for ids, n in zip(prompts, max_new):
            out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n,
                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long), eos_token_id=2)
            want.append(out[0, len(ids):].tolist())
    for path in (saved, hub):
        h = SchedulerHarness(str(path))
        try:
            _check(h, prompts, max_new, want, arrivals=[i % 3 for i in range(len(prompts))])
        finally:
            h.close()


def test_a_model_wide_enough_for_the_cpu_kernels_matches_transformers(tmp_path):
    """Hidden size 512: one decode row's projections go through kernels/cpu_linear.py (the tiny
    families' matrices are below its size) and decode attention through kernels/cpu_attention.py;
    one request at a time (one row), then all at once (rows batched)."""
    from batonlm.kernels import cpu_attention, cpu_linear
    from batonlm.model_runner.linear import ROW_KERNEL_MIN_ELEMENTS

    build_tiny_model("llama", tmp_path, hidden_size=512, intermediate_size=512, num_attention_heads=8,
                     head_dim=64, num_hidden_layers=1, initializer_range=0.05)
    copy_tokenizer(tmp_path)
    assert 512 * 512 >= ROW_KERNEL_MIN_ELEMENTS and cpu_linear.available() and cpu_attention.available()
    rng = random.Random(512)
    prompts = random_prompts(4, rng, lo=3, hi=60)
    max_new = [12] * len(prompts)
    expected = hf_greedy(str(tmp_path), prompts, max_new)
    h = SchedulerHarness(str(tmp_path))
    try:
        _check(h, prompts, max_new, expected, arrivals=[20 * i for i in range(len(prompts))])
        _check(h, prompts, max_new, expected, arrivals=[0] * len(prompts))
    finally:
        h.close()
