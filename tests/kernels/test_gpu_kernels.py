"""The compiled kernels on CUDA against the torch references on CUDA.

Run wherever CUDA is present (benchmarks/gpu_check.sh runs them with the benchmark); skipped
without a CUDA device, and under TRITON_INTERPRET=1, whose kernels the CPU tests cover.
"""

import pytest
import torch

pytest.importorskip("triton")

from kernel_helpers import (  # noqa: E402
    CHI2_CRIT,
    INTERPRETED,
    chi_square,
    filtered_distribution,
    flat_penalties,
    keys_for,
    params,
)

from batonlm.kernels import sampling as ref  # noqa: E402
from batonlm.kernels.logprobs import logprobs_reference, logprobs_triton  # noqa: E402
from batonlm.kernels.penalties import apply_penalties_reference, apply_penalties_triton  # noqa: E402

reference_flat, triton_flat = flat_penalties(apply_penalties_reference), flat_penalties(apply_penalties_triton)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(INTERPRETED, reason="compiled kernels only (TRITON_INTERPRET=1 is set)"),
]
CUDA = "cuda"
VOCABS = [32000, 151936]
B, BIG_B, DRAWS = 64, 256, 40000


def _logits(b: int, v: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device=CUDA).manual_seed(seed)
    x = torch.randn(b, v, device=CUDA, generator=g) * 2.5
    x[1] = torch.randint(-3, 3, (v,), device=CUDA, generator=g).float()  # ties
    x[2] = float("-inf")
    x[2, v - 3] = 0.0  # all -inf but one
    return x


def _row_params(b: int) -> list[tuple[float, int, float, float]]:
    temps, ks, ps, ms = [0.0, 0.6, 1.0, 1.4], [-1, 1, 20, 200], [1.0, 0.9, 0.5], [0.0, 0.05]
    return [(temps[i % 4], ks[i % 4 if i % 3 else 0], ps[i % 3], ms[i % 2]) for i in range(b)]


@pytest.mark.parametrize("v", VOCABS)
def test_argmax_and_counter_hash(v):
    x = _logits(B, v, seed=1)
    assert torch.equal(ref.argmax_triton(x), ref.argmax_reference(x))
    keys = keys_for(list(range(B)), [5] * B).to(CUDA)
    assert torch.equal(ref.counter_uniform_triton(keys, v), ref.counter_uniform(keys, v))


@pytest.mark.parametrize("v", VOCABS)
def test_keep_mask_equals_the_reference(v):
    x = _logits(B, v, seed=2)
    temp, k, p, m = params(_row_params(B), CUDA)
    probs = torch.softmax(x / torch.where(temp > 0, temp, torch.ones_like(temp))[:, None], dim=-1)
    assert torch.equal(ref.keep_mask_triton(probs, k, p, m), ref.keep_mask_reference(probs, k, p, m))


@pytest.mark.parametrize("v", VOCABS)
def test_sampled_tokens_equal_the_reference_but_for_near_ties(v):
    x = _logits(BIG_B, v, seed=3)
    temp, k, p, m = params(_row_params(BIG_B), CUDA)
    keys = keys_for(list(range(BIG_B)), [17] * BIG_B).to(CUDA)
    got = ref.sample_triton(x, ref.DrawBatch(temp, k, p, m, keys))
    expected = ref.sample_reference(x, ref.DrawBatch(temp, k, p, m, keys))
    differ = (got != expected).nonzero().flatten().tolist()
    assert len(differ) <= 2, differ
    # A difference is only allowed where the reference itself nearly draws the kernel's token.
    probs = torch.softmax(x / torch.where(temp > 0, temp, torch.ones_like(temp))[:, None], dim=-1)
    keep = ref.keep_mask_reference(probs, k, p, m)
    scores = probs / -torch.log(ref.counter_uniform(keys, v))
    for r in differ:
        assert temp[r] > 0 and keep[r, got[r]]
        assert scores[r, got[r]] >= scores[r, expected[r]] * (1 - 1e-5)


@pytest.mark.parametrize("case", [(0.7, 5, 0.8, 0.0), (1.5, -1, 1.0, 0.2), (1.0, -1, 0.6, 0.0)])
def test_sampling_frequencies_follow_the_filtered_distribution(case):
    logits = [1.2, 0.8, 0.5, 0.2, -0.2, -0.7, -1.1, -1.6]
    n = DRAWS
    out = ref.sample_triton(torch.tensor([logits], device=CUDA).repeat(n, 1), ref.DrawBatch(*params([case] * n, CUDA), keys_for([77] * n, list(range(n))).to(CUDA)))
    expected = filtered_distribution(logits, *case)
    counts = torch.bincount(out.cpu(), minlength=8).double()
    assert all(c == 0 for c, e in zip(counts.tolist(), expected) if e == 0)
    stat, dof = chi_square(counts, expected)
    assert stat < CHI2_CRIT[dof], (stat, counts.tolist(), expected)


def test_a_seeded_row_draws_the_same_token_alone_and_in_a_batch():
    x = _logits(B, VOCABS[-1], seed=4)
    rows = _row_params(B)
    mine, r = (0.9, 40, 0.9, 0.0), B // 2 - 1
    rows[r] = mine
    for pos in range(5):
        in_batch = ref.sample_triton(x, ref.DrawBatch(*params(rows, CUDA), keys_for(list(range(B)), [pos] * B).to(CUDA)))
        alone = ref.sample_triton(x[r : r + 1], ref.DrawBatch(*params([mine], CUDA), keys_for([r], [pos]).to(CUDA)))
        assert in_batch[r] == alone[0]


@pytest.mark.parametrize("v", VOCABS)
def test_penalties_equal_the_reference(v):
    g = torch.Generator(device=CUDA).manual_seed(5)
    b, slots = B, B + 16
    counts = torch.randint(0, 4, (slots, v), device=CUDA, generator=g, dtype=torch.int32)
    counts *= (torch.rand(slots, v, device=CUDA, generator=g) < 0.01).int()
    bias_ids = torch.stack([torch.randperm(v, device=CUDA, generator=g)[:8] for _ in range(b)])
    bias_ids[::3, 4:] = -1
    args = (
        _logits(b, v, seed=6), torch.randperm(slots, device=CUDA, generator=g)[:b], counts,
        torch.rand(slots, v, device=CUDA, generator=g) < 0.02,
        torch.rand(b, device=CUDA, generator=g), torch.rand(b, device=CUDA, generator=g) - 0.5,
        torch.rand(b, device=CUDA, generator=g) + 0.5,
        bias_ids, torch.randn(b, 8, device=CUDA, generator=g) * 3,
        torch.randint(-1, v, (b, 3), device=CUDA, generator=g),
    )
    assert torch.equal(triton_flat(*args), reference_flat(*args))


@pytest.mark.parametrize("v", VOCABS)
@pytest.mark.parametrize("top_n", [0, 1, 20])
def test_logprobs_equal_the_reference(v, top_n):
    x = _logits(B, v, seed=7)
    temp = torch.tensor([0.0, 0.7, 1.0, 1.3] * (B // 4), device=CUDA)
    chosen = torch.randint(0, v, (B,), device=CUDA)
    got = logprobs_triton(x, temp, chosen, top_n)
    expected = logprobs_reference(x, temp, chosen, top_n)
    assert torch.equal(got[1], expected[1])
    for a, e in ((got[0], expected[0]), (got[2], expected[2])):
        assert torch.equal(a.isinf(), e.isinf())
        assert torch.allclose(a[~e.isinf()], e[~e.isinf()], rtol=1e-6, atol=5e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_delta_compiled_equals_the_reference(dtype):
    """The LoRA shrink/expand kernels compiled, at a real model's sizes (4096 features, rank 64),
    against the torch reference on CUDA."""
    from batonlm.kernels.lora import lora_delta_reference, lora_delta_triton

    g = torch.Generator(device=CUDA).manual_seed(7)
    t, k, n, r, slots = 300, 4096, 4096, 64, 5
    x = torch.randn(t, k, device=CUDA, generator=g).to(dtype)
    a = (torch.randn(slots, r, k, device=CUDA, generator=g) / 64).to(dtype)
    b = (torch.randn(slots, n, r, device=CUDA, generator=g) / 8).to(dtype)
    perm = torch.randperm(t, device=CUDA, generator=g)[:250]
    seg_slot, seg_start = [3, 1, 4], [0, 100, 101, 250]
    out = torch.randn(t, n, device=CUDA, generator=g).to(dtype)
    ref = lora_delta_reference(out.float().clone(), x.float(), a.float(), b.float(), perm, seg_slot, seg_start)
    got = lora_delta_triton(out.clone(), x, a, b, perm, torch.tensor(seg_slot, device=CUDA),
                            torch.tensor(seg_start, device=CUDA), 149)
    tol = 1e-4 if dtype == torch.float32 else 2 ** -7
    assert torch.allclose(got.float(), ref, rtol=tol, atol=tol * float(ref.abs().max()))
