"""Dataset generation: token lengths in range, shared-prefix groups share their prefix."""

from __future__ import annotations

import random

import pytest

from batonlm.bench.datasets import CORPUS_PATH, DatasetSpec, build_requests


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_corpus_is_bundled_text():
    text = open(CORPUS_PATH, encoding="utf-8").read()
    assert len(text) > 200_000
    assert text.isascii()
    assert text.count("\n\n") > 300  # many stories


@pytest.mark.parametrize("input_len,output_len,ratio", [(200, 64, 0.5), (37, 9, 0.0), (64, 16, 1.0)])
def test_random_lengths_in_range(corpus, tokenizer, input_len, output_len, ratio):
    spec = DatasetSpec(num_prompts=150, input_len=input_len, output_len=output_len, range_ratio=ratio, seed=3)
    reqs = build_requests("random", corpus, spec)
    assert [r.index for r in reqs] == list(range(150))
    lo_in, lo_out = max(1, int(input_len * ratio)), max(1, int(output_len * ratio))
    for r in reqs:
        # The independent check: re-encode what is actually sent.
        n = len(tokenizer.encode(r.completion_prompt()))
        assert n == r.prompt_len
        assert lo_in <= n <= input_len
        assert lo_out <= r.output_len <= output_len
        assert r.prefix == "" and r.group is None
    lens = {r.prompt_len for r in reqs}
    if ratio == 1.0:
        assert lens == {input_len} and {r.output_len for r in reqs} == {output_len}
    else:  # uniform over the range: both ends of it are reached
        assert min(lens) < lo_in + (input_len - lo_in) * 0.2 and max(lens) > input_len - (input_len - lo_in) * 0.2
    assert len({r.prompt for r in reqs}) == len(reqs)  # distinct slices of the corpus


def test_seed_makes_requests_reproducible(corpus):
    spec = DatasetSpec(num_prompts=20, input_len=50, output_len=10, range_ratio=0.2, seed=7)
    assert build_requests("random", corpus, spec) == build_requests("random", corpus, spec)
    other = DatasetSpec(num_prompts=20, input_len=50, output_len=10, range_ratio=0.2, seed=8)
    assert build_requests("random", corpus, spec) != build_requests("random", corpus, other)


def test_prompt_longer_than_corpus_wraps(corpus, tokenizer):
    n = len(corpus.ids) + 500
    text, m = corpus.sample(random.Random(0), n)
    assert m == n == len(tokenizer.encode(text))


def test_shared_prefix_groups_share_their_prefix(corpus, tokenizer):
    spec = DatasetSpec(prefix_groups=4, prefix_questions=5, prefix_len=120, input_len=30, output_len=12,
                       range_ratio=0.5, seed=1)
    reqs = build_requests("shared-prefix", corpus, spec)
    assert len(reqs) == 20 and [r.index for r in reqs] == list(range(20))
    groups: dict[int, list] = {}
    for r in reqs:
        groups.setdefault(r.group, []).append(r)
        assert 15 <= len(tokenizer.encode(r.prompt)) <= 30
        assert 6 <= r.output_len <= 12
        assert r.prompt_len == len(tokenizer.encode(r.completion_prompt()))
        assert r.chat_messages() == [{"role": "system", "content": r.prefix}, {"role": "user", "content": r.prompt}]
    assert sorted(groups) == [0, 1, 2, 3] and all(len(g) == 5 for g in groups.values())
    assert [r.group for r in reqs] != sorted(r.group for r in reqs)  # shuffled, not group by group
    prefixes = set()
    for members in groups.values():
        (prefix,) = {r.prefix for r in members}
        assert len(tokenizer.encode(prefix)) == 120
        prefixes.add(prefix)
        ids = [tokenizer.encode(r.completion_prompt()) for r in members]
        for other in ids[1:]:
            # Token-level sharing (what a prefix cache sees): at least the whole prefix.
            assert common_prefix_len(ids[0], other) >= 120
        assert len({r.prompt for r in members}) == 5
    assert len(prefixes) == 4
    # Different groups share (almost) nothing.
    first = [tokenizer.encode(g[0].completion_prompt()) for g in groups.values()]
    assert max(common_prefix_len(a, b) for i, a in enumerate(first) for b in first[i + 1:]) < 10


def test_invalid_spec_is_rejected(corpus):
    with pytest.raises(ValueError, match="range_ratio"):
        DatasetSpec(range_ratio=1.5)
    with pytest.raises(ValueError, match="input_len"):
        DatasetSpec(input_len=0)
    with pytest.raises(ValueError, match="unknown dataset"):
        build_requests("alpaca", corpus, DatasetSpec())


def _sharegpt(tmp_path, convs) -> str:
    import json

    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(convs))
    return str(path)


def test_sharegpt_filters_and_lengths(corpus, tmp_path):
    from batonlm.bench.datasets import DatasetSpec, sharegpt_requests

    tok = corpus.tokenizer
    long_reply = " ".join(["the dog ran"] * 400)
    convs = [
        {"conversations": [{"from": "human", "value": "Tell me a story about a cat."},
                           {"from": "gpt", "value": "Once upon a time there was a cat."}]},
        {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello there, friend."}]},  # short
        {"conversations": [{"from": "human", "value": "Write a long story please."},
                           {"from": "gpt", "value": long_reply}]},  # over the context
        {"conversations": [{"from": "human", "value": "Only one turn here, sadly."}]},
        {"id": "no turns"},
        {"conversations": [{"from": "human", "value": "What did Lily find in the park?"},
                           {"from": "gpt", "value": "She found a big red ball under a tree."}]},
    ]
    spec = DatasetSpec(num_prompts=10, dataset_path=_sharegpt(tmp_path, convs), sharegpt_context_len=512)
    reqs = sharegpt_requests(corpus, spec)
    assert sorted(r.prompt for r in reqs) == ["Tell me a story about a cat.", "What did Lily find in the park?"]
    for r in reqs:
        reply = next(c["conversations"][1]["value"] for c in convs if c.get("conversations", [{}])[0].get("value") == r.prompt)
        assert r.prompt_len == len(tok.encode(r.prompt)) and r.output_len == len(tok.encode(reply))
    assert [r.index for r in reqs] == [0, 1]
    assert [r.prompt for r in sharegpt_requests(corpus, spec)] == [r.prompt for r in reqs]  # seeded order
    fixed = sharegpt_requests(corpus, DatasetSpec(num_prompts=1, dataset_path=spec.dataset_path, sharegpt_output_len=7,
                                                  sharegpt_context_len=512))
    assert len(fixed) == 1 and fixed[0].output_len == 7


@pytest.mark.parametrize("content", ['{"not": "a list"}', "not json", "[]"])
def test_sharegpt_bad_files_are_clear_errors(corpus, tmp_path, content):
    from batonlm.bench.datasets import DatasetSpec, sharegpt_requests

    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match="ShareGPT|passed the filters"):
        sharegpt_requests(corpus, DatasetSpec(dataset_path=str(path)))
    with pytest.raises(ValueError, match="--dataset-path"):
        sharegpt_requests(corpus, DatasetSpec())
