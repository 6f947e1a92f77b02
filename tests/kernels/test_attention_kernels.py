"""The paged attention kernels against the float64 reference, and the Triton attention backend
against the torch one: random ragged batches on cached prefixes, GQA, sliding windows, head
dims 8 / 24 / 48 / 64 / 128, float32 / bfloat16 / float16, decode split counts, FP8 pools
(e4m3, e5m2) with their per-layer scales."""

from __future__ import annotations

import math
import random

import pytest
import torch

pytest.importorskip("triton")

from kernel_helpers import interpreted_only  # noqa: E402

from batonlm.kernels.attention import (  # noqa: E402
    PagedBatch,
    decode_attention_triton,
    extend_attention_triton,
    paged_attention_reference,
)

pytestmark = interpreted_only
LAMBDA = 6.0  # probabilistic rounding-error bound, as in test_logprob_kernels.py
UNIT = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def make_case(rows, heads, kv_heads, d, dtype, seed):
    """rows: (prefix_len, extend_len) per row; every position gets a random distinct KV slot."""
    g = torch.Generator().manual_seed(seed)
    slots = sum(p + n for p, n in rows) + 50
    r2t = torch.zeros(len(rows) + 3, 512, dtype=torch.int64)
    perm = torch.randperm(slots - 1, generator=g) + 1
    used, t = 0, 0
    req_slots, prefix, ext, starts = [], [], [], []
    for i, (p, n) in enumerate(rows):
        r = i + 2  # request slots need not start at 0
        r2t[r, : p + n] = perm[used : used + p + n]
        used += p + n
        req_slots.append(r)
        prefix.append(p)
        ext.append(n)
        starts.append(t)
        t += n
    k = (torch.randn(kv_heads, slots, d, generator=g) * 2).to(dtype)
    v = torch.randn(kv_heads, slots, d, generator=g).to(dtype)
    q = (torch.randn(t, heads, d, generator=g) * 2).to(dtype)
    batch = PagedBatch(r2t, torch.tensor(req_slots), torch.tensor(prefix), torch.tensor(ext), torch.tensor(starts),
                       max(ext), max(p + n for p, n in rows))
    return q, k, v, batch


def bound(q, k, v, batch, scale, dtype, softcap=None) -> torch.Tensor:
    """[T, H, 1] bound on |float32 (or half) result - exact|: the score dot products (D terms),
    the weighted sum over the row's L keys, and in half precision the rounding of the weights
    and of the output (2 units relative to max |v|). Soft-capping is 1-Lipschitz (it passes a
    score's error on, never grows it) and adds its tanh's rounding, a few units of the cap."""
    u = UNIT[dtype]
    d = q.shape[-1]
    qmax = q.double().abs().amax(dim=(1, 2))[:, None, None]
    kmax, vmax = k.double().abs().max(), v.double().abs().max()
    lengths = torch.cat([torch.full((int(n),), int(p + n)) for p, n in zip(batch.prefix_lens, batch.extend_lens)])
    f32 = 2.0**-24
    score_err = 4 * scale * d * qmax * kmax * f32  # absolute error in a score -> relative in its weight
    if softcap is not None:
        score_err = score_err + 4 * softcap * f32
    sum_err = (LAMBDA * lengths.double().sqrt()[:, None, None] + 8) * f32
    half = 0.0 if dtype == torch.float32 else 2 * u + scale * d * qmax * kmax * u
    return vmax * (score_err + sum_err + half)


def check(got, q, k, v, batch, scale, window, dtype, k_scale=1.0, v_scale=1.0, softcap=None, sinks=None):
    """An FP8 pool is exact in float64: the reference reads it as stored * scale, and the bound
    is that of a pool holding those values (the kernels convert FP8 tiles exactly; the scales
    add one rounding to the scores' factor and one to the output's, within the bound's slack)."""
    exact = paged_attention_reference(q.double(), k.double(), v.double(), batch, scale, window, k_scale, v_scale,
                                      softcap, sinks)
    assert got.dtype == dtype and got.shape == q.shape
    err = (got.double() - exact).abs()
    tol = bound(q, k.double() * k_scale, v.double() * v_scale, batch, scale, dtype, softcap)
    assert bool((err <= tol).all()), f"error {err.max():.3g}, bound {tol.min():.3g}"


def random_rows(rng: random.Random, n: int, decode: bool) -> list[tuple[int, int]]:
    if decode:
        return [(rng.randint(0, 300), 1) for _ in range(n)]
    return [(rng.choice([0, 0, rng.randint(1, 200)]), rng.randint(1, 70)) for _ in range(n)]


@pytest.mark.parametrize("d", [8, 48, 128])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("window", [None, 7])
def test_extend_kernel_on_ragged_rows_with_prefixes(d, heads, kv_heads, window):
    rng = random.Random(d * 100 + heads * 10 + kv_heads + (window or 0))
    q, k, v, batch = make_case(random_rows(rng, 5, decode=False), heads, kv_heads, d, torch.float32, seed=d + heads)
    scale = d**-0.5
    check(extend_attention_triton(q, k, v, batch, scale, window), q, k, v, batch, scale, window, torch.float32)


@pytest.mark.parametrize("d", [8, 128])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("window", [None, 33])
@pytest.mark.parametrize("splits", [1, 5])
def test_decode_kernel_split_kv(d, heads, kv_heads, window, splits):
    rng = random.Random(d + heads + splits)
    rows = random_rows(rng, 6, decode=True) + [(0, 1)]  # a first token has one key
    q, k, v, batch = make_case(rows, heads, kv_heads, d, torch.float32, seed=splits * 7 + d)
    scale = d**-0.5
    got = decode_attention_triton(q, k, v, batch, scale, window, splits)
    check(got, q, k, v, batch, scale, window, torch.float32)
    # The extend kernel computes the same rows (a decode row is an extend of one).
    check(extend_attention_triton(q, k, v, batch, scale, window), q, k, v, batch, scale, window, torch.float32)


@pytest.mark.parametrize("kernel", ["extend", "decode"])
@pytest.mark.parametrize("modifier", ["softcap", "sinks"])
def test_score_modifiers(kernel, modifier):
    """Gemma 2's cap * tanh(score / cap), a cap small enough to bend most scores (|score| up to
    ~30 here); gpt-oss's sink logit per query head, one more term in each softmax's denominator
    (no value with it), drawn from N(0, 3) against scores of the same size (a sink only shrinks
    the weights: the bound without it holds; a first token sees its key and the sink). The
    check sees a kernel that leaves either out."""
    rng = random.Random(21)
    rows = random_rows(rng, 5, decode=kernel == "decode") + [(0, 1)]
    q, k, v, batch = make_case(rows, 8, 2, 48, torch.float32, seed=21)
    scale = 48**-0.5
    extra = {"softcap": 2.5} if modifier == "softcap" else {"sinks": torch.randn(8, generator=torch.Generator().manual_seed(3)) * 3}
    if kernel == "decode":
        got = decode_attention_triton(q, k, v, batch, scale, 9, 3, **extra)
    else:
        got = extend_attention_triton(q, k, v, batch, scale, 9, **extra)
    check(got, q, k, v, batch, scale, 9, torch.float32, **extra)
    with pytest.raises(AssertionError, match="bound"):
        check(extend_attention_triton(q, k, v, batch, scale, 9), q, k, v, batch, scale, 9, torch.float32, **extra)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_pools(dtype):
    rng = random.Random(5)
    scale = 64**-0.5
    q, k, v, batch = make_case(random_rows(rng, 4, decode=False), 8, 2, 64, dtype, seed=11)
    check(extend_attention_triton(q, k, v, batch, scale, None), q, k, v, batch, scale, None, dtype)
    q, k, v, batch = make_case(random_rows(rng, 5, decode=True), 8, 2, 64, dtype, seed=12)
    check(decode_attention_triton(q, k, v, batch, scale, None, 4), q, k, v, batch, scale, None, dtype)


def fp8_pools(k, v, cache_dtype, k_scale, v_scale):
    """k / k_scale and v / v_scale rounded to FP8 (clamped), as the KV pool stores them."""
    top = torch.finfo(cache_dtype).max
    return (k / k_scale).clamp(-top, top).to(cache_dtype), (v / v_scale).clamp(-top, top).to(cache_dtype)


# Not powers of two: a scale left out, or the two swapped, changes every product's rounding too.
K_SCALE, V_SCALE = 0.37, 2.5


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_pools_are_read_with_their_scales(cache_dtype, dtype):
    """Odd shapes: 6 query heads on 3 KV heads, head dim 24 (a padded tile of 32), ragged rows on
    prefixes, a window of 5 on the decode rows, 3 splits."""
    rng = random.Random(17)
    scale = 24**-0.5
    q, k, v, batch = make_case(random_rows(rng, 5, decode=False), 6, 3, 24, torch.float32, seed=21)
    k8, v8 = fp8_pools(k * 3, v, cache_dtype, K_SCALE, V_SCALE)
    q = q.to(dtype)
    got = extend_attention_triton(q, k8, v8, batch, scale, None, K_SCALE, V_SCALE)
    check(got, q, k8, v8, batch, scale, None, dtype, K_SCALE, V_SCALE)
    q, k, v, batch = make_case(random_rows(rng, 7, decode=True) + [(0, 1)], 6, 3, 24, torch.float32, seed=22)
    k8, v8 = fp8_pools(k * 3, v, cache_dtype, K_SCALE, V_SCALE)
    q = q.to(dtype)
    got = decode_attention_triton(q, k8, v8, batch, scale, 5, 3, K_SCALE, V_SCALE)
    check(got, q, k8, v8, batch, scale, 5, dtype, K_SCALE, V_SCALE)


def test_the_bound_sees_a_scale_left_out():
    """Reading an FP8 pool without its k or v scale is far outside the float32 bound."""
    q, k, v, batch = make_case([(40, 3)], 4, 2, 16, torch.float32, seed=5)
    k8, v8 = fp8_pools(k, v, torch.float8_e4m3fn, K_SCALE, V_SCALE)
    scale = 16**-0.5
    exact = paged_attention_reference(q.double(), k8.double(), v8.double(), batch, scale, None, K_SCALE, V_SCALE)
    tol = bound(q, k8.double() * K_SCALE, v8.double() * V_SCALE, batch, scale, torch.float32)
    for ks, vs in ((1.0, V_SCALE), (K_SCALE, 1.0), (V_SCALE, K_SCALE)):
        wrong = paged_attention_reference(q.double(), k8.double(), v8.double(), batch, scale, None, ks, vs)
        assert bool(((wrong - exact).abs() > tol).any())


def test_the_bound_sees_a_missing_key():
    """The tolerance is tight enough to catch attention that skips one key of 200."""
    q, k, v, batch = make_case([(199, 1)], 4, 4, 64, torch.float32, seed=3)
    scale = 64**-0.5
    exact = paged_attention_reference(q.double(), k.double(), v.double(), batch, scale)
    short = PagedBatch(batch.req_to_token.clone(), batch.req_slots, batch.prefix_lens, batch.extend_lens,
                       batch.extend_starts, 1, 200)
    short.req_to_token[batch.req_slots[0], 0] = short.req_to_token[batch.req_slots[0], 1]  # key 0 -> key 1
    wrong = paged_attention_reference(q.double(), k.double(), v.double(), short, scale)
    assert bool(((wrong - exact).abs() > bound(q, k, v, batch, scale, torch.float32)).any())
    assert math.isfinite(float(exact.abs().max()))


@pytest.mark.parametrize("window, cache_dtype, softcap, sinks",
                         [(None, None, None, False), (24, None, None, False), (24, torch.float8_e4m3fn, None, False),
                          (24, None, 3.0, False), (24, None, None, True)])
def test_triton_backend_equals_torch_backend_on_a_mixed_batch(window, cache_dtype, softcap, sinks):
    """Both backends through ForwardBatch: extend rows on cached prefixes and decode rows; with
    an FP8 pool, the torch backend's dequantizing gather against the kernels' scaled reads; with
    Gemma 2's logit soft-capping; with gpt-oss's attention sinks (which change the outputs)."""
    from batonlm.model_runner.attention.torch_backend import TorchAttentionBackend
    from batonlm.model_runner.attention.triton_backend import TritonAttentionBackend
    from batonlm.model_runner.forward_batch import ForwardBatch
    from batonlm.model_runner.kv_pool import KVPool
    from batonlm.model_runner.req_to_token import ReqToTokenPool

    heads, kv_heads, d, layers = 8, 2, 16, 2
    rows = [(2, (0, 30)), (5, (40, 9)), (3, (60, 1)), (7, (12, 1)), (1, (0, 1))]  # (req slot, (prefix, new))
    g = torch.Generator().manual_seed(9)
    scales = ([K_SCALE, 0.5], [V_SCALE, 2.0]) if cache_dtype is not None else (None, None)
    pool = KVPool(400, layers, kv_heads, d, torch.float32, "cpu", cache_dtype, *scales)
    r2t = ReqToTokenPool(8, 128, "cpu")
    next_slot, out_loc = 1, []
    for slot, (p, n) in rows:
        r2t.table[slot, : p + n] = torch.arange(next_slot, next_slot + p + n)
        for layer in range(layers):  # the cached prefixes are in the pool already
            pool.write(layer, r2t.table[slot, :p], torch.randn(p, kv_heads, d, generator=g),
                       torch.randn(p, kv_heads, d, generator=g))
        out_loc.append(r2t.table[slot, p : p + n])
        next_slot += p + n
    windows = (window, None)
    batch_args = (torch.cat(out_loc), [s for s, _ in rows], [p for _, (p, _) in rows], [n for _, (_, n) in rows], "cpu")
    t = sum(n for _, (_, n) in rows)
    qkv = [(torch.randn(t, heads, d, generator=g), torch.randn(t, kv_heads, d, generator=g),
            torch.randn(t, kv_heads, d, generator=g)) for _ in range(layers)]
    outs = []
    for cls in (TorchAttentionBackend, TritonAttentionBackend):
        backend = cls(pool, r2t, heads, kv_heads, d, windows)
        backend.softcap = softcap
        backend.has_sinks = sinks
        batch = ForwardBatch.build(*batch_args)
        assert len(batch.groups) == 2  # extend rows, then decode rows
        backend.prepare(batch)
        outs.append([])
        for layer, (q, k, v) in enumerate(qkv):
            backend.sinks = torch.randn(heads, generator=torch.Generator().manual_seed(layer)) * 3 if sinks else None
            outs[-1].append(backend.forward(q, k, v, layer, batch))
    if sinks:  # (without them, the torch backend's outputs differ)
        plain = TorchAttentionBackend(pool, r2t, heads, kv_heads, d, windows)
        batch = ForwardBatch.build(*batch_args)
        plain.prepare(batch)
        assert not torch.allclose(plain.forward(*qkv[0], 0, batch), outs[0][0], atol=1e-2)
    for a, b in zip(*outs):
        # Both are float32 attention over <= 49 keys of unit-scale data: a few units of 2^-24.
        torch.testing.assert_close(a, b, rtol=0, atol=2e-5)
