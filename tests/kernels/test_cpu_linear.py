"""The CPU one-row projection kernel (kernels/cpu_linear.cpp) against float64 with a bound from
the math, small matrices (the calling thread) and large ones (threaded), odd widths; `linear`
takes it for one row of a large float32 weight, eager and inside a compiled graph; a compiler
that fails leaves it unavailable and `linear` on its other paths."""

from __future__ import annotations

import pytest
import torch

from batonlm.kernels import cpu_linear
from batonlm.kernels.toolchain import cxx_compiler
from batonlm.model_runner.linear import ROW_KERNEL_MIN_ELEMENTS, linear

pytestmark = pytest.mark.skipif(cxx_compiler() is None, reason="the kernel is built with a C++ compiler")
U = 2.0**-24  # float32's unit roundoff


def within_bound(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> bool:
    """A K-term float32 dot product, summed in any order, is off by at most gamma_K * sum|w_k x_k|
    (gamma_K = K u / (1 - K u)) from the exact one."""
    k = w.shape[1]
    exact = x.double() @ w.double().T
    bound = k * U / (1 - k * U) * (x.double().abs() @ w.double().abs().T)
    return bool(((got.double() - exact).abs() <= bound).all())


@pytest.mark.parametrize(("n", "k"), [(1, 1), (7, 33), (64, 64), (512, 512), (1536, 512), (513, 1537), (100, 4099)])
def test_the_kernel_matches_float64_within_the_dot_product_bound(n, k):
    g = torch.Generator().manual_seed(n * 7 + k)
    x, w = torch.randn(1, k, generator=g), torch.randn(n, k, generator=g)
    got = cpu_linear.row_linear(x, w)
    assert got.shape == (1, n) and got.dtype == torch.float32
    assert within_bound(got, x, w)
    # A wrong row (one weight row off by one position) is outside the bound.
    wrong = got.clone()
    wrong[0, 0] = (x[0, : k - 1].double() @ w[0, 1:].double()).float() if k > 1 else got[0, 0] + 1
    assert not within_bound(wrong, x, w)


def test_linear_takes_the_kernel_for_one_row_of_a_large_weight(monkeypatch):
    g = torch.Generator().manual_seed(5)
    w, b = torch.randn(600, ROW_KERNEL_MIN_ELEMENTS // 512, generator=g), torch.randn(600, generator=g)
    x = torch.randn(1, 1, w.shape[1], generator=g)
    calls = []
    real = cpu_linear.row_linear
    monkeypatch.setattr(cpu_linear, "row_linear", lambda *a: calls.append(a) or real(*a))
    y = linear(x, w, b)
    assert len(calls) == 1 and y.shape == (1, 1, 600)
    assert within_bound(y - b, x.reshape(1, -1), w)
    linear(torch.randn(2, w.shape[1]), w)  # two rows: not the kernel
    linear(torch.randn(1, 64), torch.randn(64, 64))  # a small weight: not the kernel
    assert len(calls) == 1


def test_a_compiled_graph_calls_the_op_without_a_break():
    g = torch.Generator().manual_seed(6)
    w = torch.randn(ROW_KERNEL_MIN_ELEMENTS // 256, 256, generator=g)
    x = torch.randn(1, 256, generator=g)
    targets = []

    def backend(gm, example_inputs):  # what dynamo traced, run as traced
        targets.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    def step(x):
        return torch.relu(linear(x * 2, w)) + 1

    assert cpu_linear.available()  # asked before tracing, as CompiledDecode does
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    assert torch.equal(compiled(x), step(x))  # the same kernel both ways: the same bits
    assert "batonlm.row_linear" in targets


def test_a_compiler_that_fails_leaves_linear_on_the_blas(tmp_path, monkeypatch, caplog):
    failing = tmp_path / "failing-c++"
    failing.write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo fake 1.0 && exit 0\necho 'no such thing' >&2\nexit 1\n")
    failing.chmod(0o755)
    monkeypatch.setenv("CXX", str(failing))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cpu_linear._kernel.cache_clear()
    try:
        assert not cpu_linear.available()
        assert "could not be built" in caplog.text and "no such thing" in caplog.text
        w, x = torch.randn(512, 512), torch.randn(1, 512)
        assert within_bound(linear(x, w), x, w)  # F.linear instead
        assert not list((tmp_path / "cache").rglob("*.so"))
    finally:
        cpu_linear._kernel.cache_clear()


def test_the_op_names_what_is_wrong_with_its_inputs():
    """A C++ op: a bad call gets torch's error naming the op, not a crash."""
    w = torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="row_linear: x \\[..., K\\] and weight \\[N, K\\]"):
        cpu_linear.row_linear(torch.randn(1, 15), w)
    with pytest.raises(RuntimeError, match="row_linear: one row"):
        cpu_linear.row_linear(torch.randn(2, 16), w)
    with pytest.raises(RuntimeError, match="row_linear: float32 x and a contiguous float32 weight"):
        cpu_linear.row_linear(torch.randn(1, 16), torch.randn(16, 8).T)
