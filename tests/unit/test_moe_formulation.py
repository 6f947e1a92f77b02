"""Which formulation of the experts a MoE layer runs (batonlm/model_runner/moe.py): eager, the
grouped one; traced into a graph of one token (the compiled step's batch-1 graph: it reads K
experts' weights, not all E), the gathered one; any other graph (the 2-64 row graph's symbolic
batch size, read without a guard that would fix it to the traced size), the grouped one called
as one opaque op (float experts; quantized experts the dense one: tests/unit/test_static_experts.py).
The kernel tests check each formulation's numbers; tests/integration/test_quantized_serving.py
that MoE models' decode steps compile."""

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
    (2, False, moe_kernels.fused_moe_grouped_op),
    (2, True, moe_kernels.fused_moe_grouped_op),  # a symbolic batch size (the 2-64 row graph), traced at 2
    (4, True, moe_kernels.fused_moe_grouped_op),
])
def test_the_traced_layer_takes_the_formulation_its_shapes_call_for(moe_layer, tokens, dynamic, formulation):
    """The choice, read inside the trace (the formulations may agree to the bit on some inputs),
    and the traced layer's output, that formulation's."""
    choices = [moe_kernels.fused_moe_grouped, moe_kernels.fused_moe_dense, moe_kernels.fused_moe_gathered,
               moe_kernels.fused_moe_grouped_op]

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


def test_the_grouped_op_is_the_grouped_formulation_in_an_inductor_graph(moe_layer):
    """Compiled (inductor, the step's backend) at batch sizes the graph did not trace, the op's
    output is the eager grouped experts' bit for bit: the graph hands it the rows, their routes
    and the weights, and takes its result as it is (the router around it is the graph's own
    float32 math, checked by the compiled step's tests)."""
    w13, w2, act = moe_layer.experts.w13, moe_layer.experts.w2, moe_layer.act

    def experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return moe_kernels.fused_moe_grouped_op(x.relu(), w13, w2, ids, weights, act) * 2

    torch._dynamo.reset()
    compiled = torch.compile(experts, backend="inductor", fullgraph=True, dynamic=True)
    with torch.no_grad():
        for tokens in (2, 5, 9):
            x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens))
            ids, weights = moe_layer.route(x)
            want = moe_kernels.fused_moe_grouped(x.relu(), w13, w2, ids, weights, act) * 2
            assert torch.equal(compiled(x, ids, weights), want)


def test_eager_takes_the_grouped_formulation(moe_layer):
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(moe_layer(x), _expected(moe_layer, x, moe_kernels.fused_moe_grouped))
