"""Which formulation of the experts a MoE layer runs (batonlm/model_runner/moe.py): eager, the
grouped one; traced into a graph of one token (the compiled step's batch-1 graph: it reads K
experts' weights, not all E), the gathered one; any other graph (the 2-64 row graph's symbolic
batch size, read without a guard that would fix it to the traced size), the dense one. The kernel
tests check each formulation's numbers; tests/integration/test_quantized_serving.py that MoE
models' decode steps compile."""

from __future__ import annotations

import pytest
import torch

from batonlm.kernels import moe as moe_kernels
from batonlm.model_runner.model_config import ModelConfig
from batonlm.model_runner.model_loader import load_model
from batonlm.model_runner.moe import SparseMoE, _formulation


@pytest.fixture(scope="module")
def moe_layer(tiny_models) -> SparseMoE:
    model = load_model(ModelConfig.from_hf(tiny_models["qwen3_moe"]), torch.float32, "cpu")[0]  # 8 experts, top 3
    layer = next(m for m in model.modules() if isinstance(m, SparseMoE))
    assert (layer.opts.num_experts, layer.opts.top_k) == (8, 3)
    return layer


def _expected(layer: SparseMoE, x: torch.Tensor, formulation: moe_kernels.MoEFunction) -> torch.Tensor:
    ids, weights = layer.route(x)
    return formulation(x, layer.experts.w13, layer.experts.w2, ids, weights, layer.act)


@pytest.mark.parametrize("tokens, dynamic, formulation", [
    (1, False, moe_kernels.fused_moe_gathered),  # the batch-1 graph: 3 copies of 8 experts
    (2, False, moe_kernels.fused_moe_dense),
    (2, True, moe_kernels.fused_moe_dense),  # a symbolic batch size (the 2-64 row graph), traced at 2
    (4, True, moe_kernels.fused_moe_dense),
])
def test_the_traced_layer_takes_the_formulation_its_shapes_call_for(moe_layer, tokens, dynamic, formulation):
    """The choice, read inside the trace (the formulations may agree to the bit on some inputs),
    and the traced layer's output, that formulation's."""
    choices = [moe_kernels.fused_moe_grouped, moe_kernels.fused_moe_dense, moe_kernels.fused_moe_gathered]

    def probe(x: torch.Tensor) -> torch.Tensor:
        chosen = _formulation(x, moe_layer.opts)
        return x[:, :1] * 0 + next(i for i, f in enumerate(choices) if f is chosen)

    torch._dynamo.reset()
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens))
    with torch.no_grad():
        code = torch.compile(probe, backend="eager", fullgraph=True, dynamic=dynamic)(x)
        assert choices[int(code[0, 0])] is formulation
        traced = torch.compile(moe_layer, backend="eager", fullgraph=True, dynamic=dynamic)(x)
        assert torch.equal(traced, _expected(moe_layer, x, formulation))


def test_eager_takes_the_grouped_formulation(moe_layer):
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(moe_layer(x), _expected(moe_layer, x, moe_kernels.fused_moe_grouped))
