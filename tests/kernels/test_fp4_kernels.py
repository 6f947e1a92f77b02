"""NVFP4 activations (batonlm/kernels/fp4.py): quantized to FP4 E2M1 per token and group of 16 and
back, as compressed-tensors defines it (its own functions give the same values on the `nvfp4`
fixture: tests/unit/test_quantized_checkpoints.py).

What each value must be, from the format: its group's scale is a float8 e4m3 value (>= 2^-9 or the
0.125 that stands for 0), the step is scale / global, and the value is an E2M1 value (0, 0.5, 1,
1.5, 2, 3, 4, 6, signed) times the step, the nearest one to x / step (ties to even) after
clamping to [-6, 6]: within half a grid spacing of x unless clamped.
"""

from __future__ import annotations

import pytest
import torch

from batonlm.kernels.fp4 import nvfp4_fake_quant, round_e2m1

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
    values = torch.round(got.double() / step.double() * 2) / 2  # the E2M1 value (the product rounded once)
    assert bool(torch.isin(values.abs(), E2M1.double()).all())
    assert torch.equal(got, values.float() * step)  # value * step, one float32 rounding
    # nearest: no other grid value is closer to x / step (clamped to +-6)
    target = (xf / step.double()).clamp(-6, 6)
    grid = torch.cat([-E2M1.flip(0), E2M1]).double()
    best = (target.unsqueeze(-1) - grid).abs().amin(-1)
    assert bool(((values - target).abs() <= best + 1e-6).all())


def test_a_zero_group_quantizes_to_zeros_and_clamping_saturates_at_six_steps():
    x = torch.zeros(2, 32)
    x[1, 16:] = torch.linspace(-3, 3, 16)
    got = nvfp4_fake_quant(x, torch.tensor([100.0]))
    assert not got[:, :16].any() and not got[0].any()
    step = (torch.tensor(100.0) * (torch.tensor(3.0) / 6)).to(torch.float8_e4m3fn).float() / 100
    assert got[1, 16:].abs().max() <= 6 * step + 1e-7


def test_a_compiled_graph_gives_the_eager_values():
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(3)) * 3
    eager = nvfp4_fake_quant(x, torch.tensor([300.0]))
    compiled = torch.compile(nvfp4_fake_quant, backend="inductor", fullgraph=True)(x, torch.tensor([300.0]))
    assert torch.equal(eager, compiled)


@pytest.mark.parametrize("args,name", [((torch.zeros(2, 24), torch.ones(1)), "x"),
                                       ((torch.zeros(2, 32), torch.ones(2)), "global_scale"),
                                       ((torch.zeros(2, 32, dtype=torch.int32), torch.ones(1)), "x")])
def test_a_bad_argument_is_named(args, name):
    with pytest.raises(ValueError, match=f"^{name}:"):
        nvfp4_fake_quant(*args)


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
    graph = torch.cuda.CUDAGraph()
    nvfp4_fake_quant(xc, gc)  # warm up outside the capture
    with torch.cuda.graph(graph):
        out = nvfp4_fake_quant(xc, gc)
    xc.copy_(x.flip(0).cuda())
    graph.replay()
    assert torch.equal(out.cpu(), nvfp4_fake_quant(x.flip(0), glob))
