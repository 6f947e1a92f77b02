"""NVFP4 activations (batonlm/kernels/fp4.py): quantized to FP4 E2M1 per token and group of 16 and
back, as compressed-tensors defines it (its own functions give the same values on the `nvfp4`
fixture: tests/unit/test_quantized_checkpoints.py).

What each value must be, from the format: its group's scale is a float8 e4m3 value (>= 2^-9 or the
0.125 that stands for 0), the step is scale / global, and the value is an E2M1 value (0, 0.5, 1,
1.5, 2, 3, 4, 6, signed) times the step, the nearest one to x / step (ties to even) after
clamping to [-6, 6]: within half a grid spacing of x unless clamped.

ModelOpt's NVFP4 (`modelopt_nvfp4_fake_quant`) the same way with its own order of operations: the
layer's `input_scale` t, a group's scale fp8(amax / (6 t)) clamped to [2^-9, 448], step = scale * t
(the `modelopt-nvfp4` fixture's test compares it with ModelOpt's own `NVFP4QTensor`).
"""

from __future__ import annotations

import pytest
import torch

from batonlm.kernels.fp4 import modelopt_nvfp4_fake_quant, nvfp4_fake_quant, round_e2m1

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def test_e2m1_rounding_is_to_nearest_with_ties_to_even():
    v = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.26, 0.74, 2.49, 5.01, 7.0, -0.75, -5.0, 0.0, -0.1])
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, 0.5, 2.0, 6.0, 6.0, -1.0, -4.0, 0.0, -0.0])
    assert torch.equal(round_e2m1(v), want)


@pytest.mark.parametrize("m,k,glob", [(1, 16, 452.0), (5, 256, 186.0), (3, 64, 2800.0)])
def test_each_value_is_its_groups_nearest_e2m1_multiple(m, k, glob):
    g = torch.Generator().manual_seed(m + k)
    x = torch.randn(m, k, generator=g) * torch.rand(m, k // 16, 1, generator=g).repeat_interleave(16, 2).view(m, k) * 4
    global_scale = torch.tensor([glob])
    got = nvfp4_fake_quant(x, global_scale).view(m, k // 16, 16)
    xf = x.double().view(m, k // 16, 16)
    scale = (global_scale * (x.view(m, k // 16, 16).abs().amax(2, keepdim=True) / 6)).to(torch.float8_e4m3fn).float()
    step = torch.where(scale == 0, 0.125, scale) / global_scale  # float32, as the format computes it
    _check_nearest(got, xf, step)


def _check_nearest(got: torch.Tensor, x: torch.Tensor, step: torch.Tensor) -> None:
    """got [M, G, 16] is an E2M1 value times its group's float32 step, the nearest to x / step."""
    values = torch.round(got.double() / step.double() * 2) / 2  # the E2M1 value (the product rounded once)
    assert bool(torch.isin(values.abs(), E2M1.double()).all())
    assert torch.equal(got, values.float() * step)  # value * step, one float32 rounding
    target = (x.double() / step.double()).clamp(-6, 6)
    grid = torch.cat([-E2M1.flip(0), E2M1]).double()
    best = (target.unsqueeze(-1) - grid).abs().amin(-1)
    assert bool(((values - target).abs() <= best + 1e-6).all())


@pytest.mark.parametrize("m,k,t", [(1, 16, 2e-3), (5, 256, 5e-3), (64, 64, 4e-4)])
def test_modelopts_values_are_its_groups_nearest_e2m1_multiples(m, k, t):
    """Groups over the calibrated range (scale clamped at 448: saturated), within it, and near
    zero (scale clamped up to 2^-9)."""
    g = torch.Generator().manual_seed(m + k)
    x = torch.randn(m, k, generator=g) * torch.rand(m, k // 16, 1, generator=g).repeat_interleave(16, 2).view(m, k) * 4
    x[0, :16] *= 1e-6
    scale_t = torch.tensor([t])
    got = modelopt_nvfp4_fake_quant(x, scale_t).view(m, k // 16, 16)
    xg = x.view(m, k // 16, 16)
    scale = (xg.abs().amax(2, keepdim=True) / (scale_t * 6)).clamp(2.0**-9, 448).to(torch.float8_e4m3fn).float()
    _check_nearest(got, xg, scale * scale_t)


@pytest.mark.parametrize("fn", [nvfp4_fake_quant, modelopt_nvfp4_fake_quant])
def test_a_scale_per_row_is_each_rows_own(fn):
    """A MoE's routed rows, each quantized by its expert's scale: row i as if alone with scale i."""
    x = torch.randn(5, 48, generator=torch.Generator().manual_seed(4)) * 3
    scales = torch.tensor([1e-3, 4e-3, 2e-4, 1e-3, 7e-3]) if fn is modelopt_nvfp4_fake_quant else \
        torch.tensor([300.0, 90.0, 2000.0, 300.0, 40.0])
    got = fn(x, scales)
    for i in range(5):
        assert torch.equal(got[i : i + 1], fn(x[i : i + 1], scales[i]))
    assert not torch.equal(got, fn(x, scales[:1]))


def test_compressed_tensors_order_of_the_same_operations_gives_other_values():
    """Why ModelOpt's layers run their own arithmetic: with the global scale 1 / t, steps a float32
    ulp apart (exact IEEE operations: the same on every machine)."""
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * 3
    t = torch.tensor([2.2e-3])
    assert not torch.equal(nvfp4_fake_quant(x, 1 / t), modelopt_nvfp4_fake_quant(x, t))


def test_a_zero_group_quantizes_to_zeros_and_clamping_saturates_at_six_steps():
    x = torch.zeros(2, 32)
    x[1, 16:] = torch.linspace(-3, 3, 16)
    got = nvfp4_fake_quant(x, torch.tensor([100.0]))
    assert not got[:, :16].any() and not got[0].any()
    step = (torch.tensor(100.0) * (torch.tensor(3.0) / 6)).to(torch.float8_e4m3fn).float() / 100
    assert got[1, 16:].abs().max() <= 6 * step + 1e-7


@pytest.mark.parametrize("fn,scale", [(nvfp4_fake_quant, 300.0), (modelopt_nvfp4_fake_quant, 1 / 300)])
def test_a_compiled_graph_gives_the_eager_values(fn, scale):
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(3)) * 3
    eager = fn(x, torch.tensor([scale]))
    compiled = torch.compile(fn, backend="inductor", fullgraph=True)(x, torch.tensor([scale]))
    assert torch.equal(eager, compiled)


@pytest.mark.parametrize("args,name", [((torch.zeros(2, 24), torch.ones(1)), "x"),
                                       ((torch.zeros(2, 32), torch.ones(3)), "global_scale"),
                                       ((torch.zeros(2, 32, dtype=torch.int32), torch.ones(1)), "x")])
def test_a_bad_argument_is_named(args, name):
    with pytest.raises(ValueError, match=f"^{name}:"):
        nvfp4_fake_quant(*args)
    with pytest.raises(ValueError, match=f"^{name.replace('global_scale', 'input_scale')}:"):
        modelopt_nvfp4_fake_quant(*args)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_values_are_the_cpus_and_a_cuda_graph_captures_them():
    """On CUDA the same values bit for bit (tensor divisions and float8 rounding are exact there
    too), and the quantization replays in a CUDA graph (no host copies or synchronisation)."""
    x = torch.randn(64, 4096, generator=torch.Generator().manual_seed(5)) * 3
    glob = torch.tensor([200.0])
    want = nvfp4_fake_quant(x, glob)
    xc, gc = x.cuda(), glob.cuda()
    assert torch.equal(nvfp4_fake_quant(xc, gc).cpu(), want)
    assert torch.equal(modelopt_nvfp4_fake_quant(xc, 1 / gc).cpu(), modelopt_nvfp4_fake_quant(x, 1 / glob))
    graph = torch.cuda.CUDAGraph()
    nvfp4_fake_quant(xc, gc)  # warm up outside the capture
    with torch.cuda.graph(graph):
        out = nvfp4_fake_quant(xc, gc)
    xc.copy_(x.flip(0).cuda())
    graph.replay()
    assert torch.equal(out.cpu(), nvfp4_fake_quant(x.flip(0), glob))
