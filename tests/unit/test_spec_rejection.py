"""Rejection sampling of draft-model drafts (`spec_verify.rejection_verify`) reproduces the
target's distribution whatever the draft's: chi-square goodness of fit at p = 0.001 over many
seeded draws of a short continuation, for the first token and the second given the first was
accepted, against a draft distribution far from the target's. Greedy rows reduce to accepting
while the draft is the target's argmax."""

from __future__ import annotations

import torch
from scipy.stats import chisquare

from batonlm.model_runner.spec_verify import DRAFT_SALT, race, rejection_verify, salted

V = 6
DRAWS = 20000


def _dists():
    g = torch.Generator().manual_seed(7)
    p = torch.softmax(torch.randn(3, V, generator=g) * 1.5, dim=-1)  # target, rows: positions 0, 1, 2
    q = torch.softmax(torch.randn(2, V, generator=g) * 1.5, dim=-1)  # draft, positions 0, 1
    return p, q


def test_emitted_tokens_follow_the_target_distribution():
    p, q = _dists()
    assert (p[:2] - q).abs().max() > 0.2  # a draft far from the target
    g = torch.Generator().manual_seed(11)
    first, second = torch.zeros(V), torch.zeros(V)
    for _ in range(DRAWS):
        keys = torch.randint(0, 2**32, (3,), generator=g, dtype=torch.int64)
        drafts = torch.stack([race(q[j : j + 1], salted(keys[j : j + 1], DRAFT_SALT))[0] for j in range(2)])
        a, token = rejection_verify(p, q, drafts, keys)
        emitted = drafts[:a].tolist() + ([token] if token is not None else [])
        first[emitted[0]] += 1
        if a >= 1:
            second[emitted[1]] += 1
    n2 = float(second.sum())
    assert n2 > DRAWS / 10
    for counts, dist, n in ((first, p[0], DRAWS), (second, p[1], n2)):
        expected = dist.double() / dist.double().sum() * n
        stat = chisquare(counts.double().numpy(), expected.numpy())
        assert stat.pvalue > 0.001, (counts, dist * n, stat)
    # The draft alone would fail the same test: the test can tell the distributions apart.
    g = torch.Generator().manual_seed(3)
    draft_only = torch.zeros(V)
    for _ in range(DRAWS):
        key = torch.randint(0, 2**32, (1,), generator=g, dtype=torch.int64)
        draft_only[race(q[:1], salted(key, DRAFT_SALT))[0]] += 1
    expected = p[0].double() / p[0].double().sum() * DRAWS
    assert chisquare(draft_only.double().numpy(), expected.numpy()).pvalue < 1e-6


def test_the_same_keys_give_the_same_draws():
    p, q = _dists()
    keys = torch.tensor([5, 6, 7], dtype=torch.int64)
    drafts = torch.tensor([1, 2])
    assert rejection_verify(p, q, drafts, keys) == rejection_verify(p, q, drafts, keys)


def test_greedy_rows_accept_while_the_draft_is_the_argmax():
    one_hot = torch.eye(V)
    p = one_hot[[2, 4, 1]]  # the target's greedy tokens 2, 4, then 1
    q = one_hot[[2, 5]]  # the draft's: 2 (right), 5 (wrong)
    keys = torch.tensor([1, 2, 3], dtype=torch.int64)
    assert rejection_verify(p, q, torch.tensor([2, 5]), keys) == (1, 4)  # the target's token replaces 5
    assert rejection_verify(p, one_hot[[2, 4]], torch.tensor([2, 4]), keys) == (2, None)  # all in: p's sample
