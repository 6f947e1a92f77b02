"""The CPU decode-attention kernel (kernels/cpu_attention.cpp: keys and values read in place
through the rows' KV slots) against its reference in float64: grouped-query heads, odd head dims,
ragged lengths, masked-out keys in the middle (sliding windows), a row with nothing to attend to
(padding), slots anywhere in the pool; and a compiler that fails leaves it unavailable."""

from __future__ import annotations

import pytest
import torch

from batonlm.kernels import cpu_attention
from batonlm.kernels.toolchain import cxx_compiler

pytestmark = pytest.mark.skipif(cxx_compiler() is None, reason="the kernel is built with a C++ compiler")
U = 2.0**-24  # float32's unit roundoff


def error_bound(q, k, v, idx, mask, scale) -> torch.Tensor:
    """Per row and head, from the float32 operations: each score (a D-term dot product) is off
    by at most D*u*scale*sum|q_d k_d| (Delta, the row's largest); the softmax weights then by a
    factor up to exp(2 Delta) - 1 plus the roundings of exp, the sum and the division (L + 4)u;
    the output sums L weighted values (L*u more): |error| <= (2 Delta + (2L + 8)u) max|v|, with
    half as much again for the second-order terms."""
    b, kvh, g, d = q.shape
    length = idx.shape[1]
    keys = k.double().index_select(1, idx.reshape(-1)).view(kvh, b, length, d).transpose(0, 1)
    values = v.double().index_select(1, idx.reshape(-1)).view(kvh, b, length, d).transpose(0, 1)
    dots = torch.einsum("bhgd,bhld->bhgl", q.double().abs(), keys.abs()) * scale * d * U
    delta = dots.masked_fill(~mask[:, None, None, :], 0).amax(-1, keepdim=True)
    vmax = values.abs().masked_fill(~mask[:, None, :, None], 0).amax(dim=(-1, -2))[:, :, None, None]
    return 1.5 * (2 * delta + (2 * length + 8) * U) * vmax


@pytest.mark.parametrize(("rows", "kv_heads", "group", "d", "length"),
                         [(1, 1, 1, 8, 1), (3, 2, 4, 48, 37), (5, 8, 1, 64, 130), (2, 1, 7, 80, 300), (64, 2, 2, 32, 17)])
def test_the_kernel_matches_the_float64_reference(rows, kv_heads, group, d, length):
    g = torch.Generator().manual_seed(rows * 1000 + d)
    slots = 4 * rows * length + 11
    q = torch.randn(rows, kv_heads, group, d, generator=g) * 2
    k, v = torch.randn(kv_heads, slots, d, generator=g), torch.randn(kv_heads, slots, d, generator=g)
    idx = torch.randint(0, slots, (rows, length), generator=g)
    lens = torch.randint(1, length + 1, (rows,), generator=g)
    mask = torch.arange(length)[None, :] < lens[:, None]
    if length > 4:  # a sliding window: the row's first keys masked out too
        mask[0, : length // 3] = False
    if rows > 2:
        mask[1] = False  # a padding row: zeros
    scale = d**-0.5
    got = cpu_attention.decode_attention(q, k, v, idx, mask, scale)
    want = cpu_attention.reference(q.double(), k.double(), v.double(), idx, mask, scale)
    assert got.dtype == torch.float32 and got.shape == q.shape
    bound = error_bound(q, k, v, idx, mask, scale)
    assert ((got.double() - want).abs() <= bound).all(), ((got.double() - want).abs() / bound).max()
    if rows > 2:
        assert (got[1] == 0).all()


def test_the_op_traces_into_a_compiled_graph():
    """As the compiled decode step calls it: a graph around the op, no graph break."""
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(4, 2, 2, 16, generator=g), torch.randn(2, 50, 16, generator=g), torch.randn(2, 50, 16, generator=g)
    idx, mask = torch.randint(0, 50, (4, 9), generator=g), torch.rand(4, 9, generator=g) < 0.8
    mask[:, 0] = True

    def step(q, k, v, idx, mask):
        return torch.ops.batonlm.paged_decode_attention(q * 2, k, v, idx, mask, 0.25) + 1

    assert cpu_attention.available()  # loaded before tracing, as the compiled decode step does
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(q, k, v, idx, mask), step(q, k, v, idx, mask))


def test_the_op_names_what_is_wrong_with_its_inputs():
    """A C++ op: bad shapes and dtypes get torch's error naming the op, not a crash."""
    assert cpu_attention.available()
    q, k = torch.randn(2, 2, 1, 16), torch.randn(2, 10, 16)
    idx, mask = torch.zeros(2, 3, dtype=torch.int64), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="paged_decode_attention: q \\[B, KVH, G, D\\]"):
        cpu_attention.decode_attention(q, k[:1], k[:1], idx, mask, 0.25)  # one KV head for two
    with pytest.raises(RuntimeError, match="paged_decode_attention: float32 q"):
        cpu_attention.decode_attention(q.double(), k, k, idx, mask, 0.25)


def test_a_compiler_that_fails_leaves_the_kernel_unavailable(tmp_path, monkeypatch, caplog):
    failing = tmp_path / "failing-c++"
    failing.write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo fake 1.0 && exit 0\necho 'no such thing' >&2\nexit 1\n")
    failing.chmod(0o755)
    monkeypatch.setenv("CXX", str(failing))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # nothing built before
    cpu_attention._kernel.cache_clear()
    try:
        assert not cpu_attention.available()
        assert "could not be built" in caplog.text and "no such thing" in caplog.text
        assert not list((tmp_path / "cache").rglob("*.so"))  # no half-written library left behind
    finally:
        cpu_attention._kernel.cache_clear()
