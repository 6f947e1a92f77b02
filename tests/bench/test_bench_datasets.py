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
        build_requests("sharegpt", corpus, DatasetSpec())
