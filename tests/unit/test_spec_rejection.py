"""Rejection sampling of draft-model drafts (`spec_verify.rejection_verify`) reproduces the
target's distribution whatever the draft's, for the first token and the second given the first
was accepted, against a draft distribution far from the target's. Greedy rows reduce to
accepting while the draft is the target's argmax.

The trials are independent, so they run batched: `_batched_trials` states the standard
algorithm with the same counter RNG over many trials at once, `rejection_verify` must give
exactly its (accepted, token) on thousands of them, and the batched trials' emitted tokens
must fit the target distribution (chi-square). Exact agreement on the same keys bounds the
distance between the two: if the emitted tokens of `rejection_verify` followed a law at total
variation d from the batched one, a trial would disagree with probability >= d, and CALLS
trials would all agree with probability <= (1 - d)^CALLS (< 1e-8 for d = 0.005, a tenth of
what the chi-square over 20000 calls at p = 0.001 could see before)."""

from __future__ import annotations

import torch
from scipy.stats import chisquare

from batonlm.kernels import sampling as ref
from batonlm.model_runner.spec_verify import ACCEPT_SALT, DRAFT_SALT, race, rejection_verify, salted

V = 6
DRAWS = 200_000  # batched trials for the chi-square tests
CALLS = 4000  # trials run through rejection_verify itself
# Under the null a chi-square p-value is uniform: each fit fails a correct sampler with
# probability ALPHA (whatever the seed), so the test's false-failure probability is 2 * ALPHA.
ALPHA = 1e-6


def _dists():
    g = torch.Generator().manual_seed(7)
    p = torch.softmax(torch.randn(3, V, generator=g) * 1.5, dim=-1)  # target, rows: positions 0, 1, 2
    q = torch.softmax(torch.randn(2, V, generator=g) * 1.5, dim=-1)  # draft, positions 0, 1
    return p, q


def _batched_trials(p, q, keys):
    """keys [N, 3]: each trial's counter keys. Returns (drafts [N, 2] drawn from q, drafts
    accepted [N], the token drawn at the rejection [N] (-1 when both were accepted)): draft j
    is accepted with probability min(1, p_j(d) / q_j(d)), and at the first rejection the token
    is drawn from max(p_j - q_j, 0) renormalised."""
    n = keys.shape[0]
    drafts = torch.stack([race(q[j].expand(n, V), salted(keys[:, j], DRAFT_SALT)) for j in range(2)], dim=1)
    u = ref.hash_to_uniform(salted(keys[:, :2], ACCEPT_SALT)).double()
    pd, qd = p[:2].double(), q.double()
    cols = torch.arange(2)[None, :].expand(n, 2)
    accept = u * qd[cols, drafts] < pd[cols, drafts]  # [N, 2]
    residual = (p[:2] - q).clamp(min=0.0)
    residual = residual / residual.sum(dim=-1, keepdim=True)  # p != q here: no all-zero row
    redraw = torch.stack([race(residual[j].expand(n, V), keys[:, j]) for j in range(2)], dim=1)
    accepted = torch.where(accept[:, 0], torch.where(accept[:, 1], 2, 1), 0)
    token = torch.where(accepted == 2, -1, redraw.gather(1, accepted.clamp(max=1)[:, None])[:, 0])
    return drafts, accepted, token


def _keys(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 2**32, (n, 3), generator=torch.Generator().manual_seed(seed), dtype=torch.int64)


def test_rejection_verify_gives_the_batched_trials_outcomes():
    p, q = _dists()
    keys = _keys(CALLS, 11)
    drafts, accepted, token = _batched_trials(p, q, keys)
    got = [rejection_verify(p, q, drafts[i], keys[i]) for i in range(CALLS)]
    want = [(int(a), None if int(t) < 0 else int(t)) for a, t in zip(accepted, token)]
    assert got == want
    assert set(accepted.tolist()) == {0, 1, 2}  # every branch: rejected first, rejected second, all in


def _fits(counts: torch.Tensor, dist: torch.Tensor) -> float:
    expected = dist.double() / dist.double().sum() * counts.sum().double()
    return chisquare(counts.double().numpy(), expected.numpy()).pvalue


def test_emitted_tokens_follow_the_target_distribution():
    p, q = _dists()
    assert (p[:2] - q).abs().max() > 0.2  # a draft far from the target
    drafts, accepted, token = _batched_trials(p, q, _keys(DRAWS, 12))
    first = torch.where(accepted >= 1, drafts[:, 0], token)
    second = torch.where(accepted == 2, drafts[:, 1], token)[accepted >= 1]
    assert second.numel() > DRAWS / 10
    for emitted, dist in ((first, p[0]), (second, p[1])):
        counts = torch.bincount(emitted, minlength=V)
        assert _fits(counts, dist) > ALPHA, (counts, dist * emitted.numel())
    # The test can tell the distributions apart: the draft alone fails it, and so does a
    # verifier that forgets the residual (redrawing from p at a rejection).
    assert _fits(torch.bincount(drafts[:, 0], minlength=V), p[0]) < ALPHA
    plain = race(p[0].expand(DRAWS, V), _keys(DRAWS, 13)[:, 0])
    naive = torch.where(accepted >= 1, drafts[:, 0], plain)
    assert _fits(torch.bincount(naive, minlength=V), p[0]) < ALPHA


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
