"""MoE experts with static (calibrated) activation scales kept quantized: AutoFP8's FP8 checkpoints
(`quant_method: fp8, activation_scheme: static`, Mixtral-8x7B-Instruct-FP8: FP8 weights per
tensor, one input scale per layer) as `Fp8Experts`, llm-compressor's W8A8 int8 with static
activations as `Int8Experts`, each expert with its own input scales (they were dequantized, with
float activations, before). Checked here: the buffers are the checkpoint's codes, scales and input
scales (gate and up fused: the larger of theirs, as the dense fused projections take it), the layer
computes the kernels' result on the checkpoint's own tensors (batonlm/kernels/moe_fp8.py and
moe_int8.py, checked against float64 in tests/kernels), eager and traced, and two ranks sum to one
(every rank quantizes with the same scales). The dense static FP8 path's logits against
transformers' float model with each projection's input quantized by its scale.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from quant_formats import LINEARS
from quant_w8a8 import write_static_checkpoint
from safetensors.torch import load_file

from batonlm.distributed.group import TPGroup
from batonlm.kernels.moe_fp8 import fused_moe_fp8_dense, fused_moe_fp8_gathered, fused_moe_fp8_grouped
from batonlm.kernels.moe_int8 import fused_moe_int8_dense, fused_moe_int8_gathered, fused_moe_int8_grouped
from batonlm.model_runner.model_config import ModelConfig
from batonlm.model_runner.model_loader import load_model, tp_layout
from batonlm.model_runner.moe import Fp8Experts, Int8Experts, SparseMoE
from batonlm.model_runner.quantization.linear import Fp8Linear, Int8Linear
from batonlm.model_runner.weight_loader import checkpoint_name

FAMILIES = {"qwen3_moe": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}
KINDS = {"autofp8": (Fp8Experts, fused_moe_fp8_grouped, fused_moe_fp8_dense, fused_moe_fp8_gathered),
         "int8": (Int8Experts, fused_moe_int8_grouped, fused_moe_int8_dense, fused_moe_int8_gathered)}
SOURCE = Path(__file__).resolve().parents[1] / "data" / "quantized" / "fp32-source"
PROMPT = torch.tensor([1, 403, 407, 261, 378, 32, 45, 290])


@pytest.fixture(scope="module")
def static_moe(tiny_models, tmp_path_factory) -> dict[tuple[str, str], Path]:
    """(family, kind) -> its checkpoint; every layer with its own input scale (gate and up differ)."""
    root = tmp_path_factory.mktemp("static")
    out = {}
    for seed, (family, kind) in enumerate((f, k) for f in FAMILIES for k in KINDS):
        path = root / f"{family}-{kind}"
        write_static_checkpoint(tiny_models[family], path, kind, LINEARS + FAMILIES[family], seed=seed,
                                shared_inputs=False)
        out[family, kind] = path
    return out


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def _moe_layers(model) -> list[tuple[str, SparseMoE]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, SparseMoE)]


def _stacked(tensors: dict[str, torch.Tensor], prefix: str, names: tuple[str, ...], experts: int):
    """An MoE layer's experts straight from the checkpoint, as the experts hold them: codes, a
    float32 scale per output channel (a per-tensor one repeated), and each expert's input scales
    (gate/up: the larger of the two)."""
    gate, up, down = names

    def get(e: int, n: str, leaf: str) -> torch.Tensor:
        return tensors[f"{prefix}.{e}.{n}.{leaf}"]

    def scale(e: int, n: str) -> torch.Tensor:
        w = get(e, n, "weight")
        return get(e, n, "weight_scale").float().reshape(-1).expand(w.shape[0])

    def input_scale(e: int, n: str) -> torch.Tensor:
        return get(e, n, "input_scale").float().reshape(())

    rng = range(experts)
    w13_q = torch.stack([torch.cat([get(e, gate, "weight"), get(e, up, "weight")]) for e in rng])
    w13_s = torch.stack([torch.cat([scale(e, gate), scale(e, up)]) for e in rng])
    w2_q = torch.stack([get(e, down, "weight") for e in rng])
    w2_s = torch.stack([scale(e, down) for e in rng])
    a13 = torch.stack([torch.maximum(input_scale(e, gate), input_scale(e, up)) for e in rng])
    a2 = torch.stack([input_scale(e, down) for e in rng])
    return (w13_q, w13_s, w2_q, w2_s), (a13, a2)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    view = (lambda t: t.view(torch.uint8)) if a.dtype == torch.float8_e4m3fn else (lambda t: t)
    return a.dtype == b.dtype and torch.equal(view(a), view(b))


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_static_experts_hold_and_compute_the_checkpoints_experts(family: str, kind: str, static_moe) -> None:
    experts_type, grouped, dense, gathered = KINDS[kind]
    path = static_moe[family, kind]
    cfg = ModelConfig.from_hf(path)
    model = load_model(cfg, torch.float32, "cpu")[0]  # W8A8: kept quantized on the CPU too
    layers = _moe_layers(model)
    assert layers and all(isinstance(m.experts, experts_type) for _, m in layers)
    tensors = load_file(str(path / "model.safetensors"))
    g = torch.Generator().manual_seed(7)
    gate_larger: list[bool] = []
    for name, moe in layers:
        experts = moe.experts
        assert isinstance(experts, (Fp8Experts, Int8Experts))
        weights_want, scales_want = _stacked(tensors, checkpoint_name(model, name + ".experts"), FAMILIES[family],
                                             experts.w13_q.shape[0])
        held = (experts.w13_q, experts.w13_scale, experts.w2_q, experts.w2_scale)
        assert all(_same(a, b) for a, b in zip(held, weights_want))
        assert experts.w13_input_scale is not None and experts.w2_input_scale is not None
        assert torch.equal(experts.w13_input_scale, scales_want[0]) and torch.equal(experts.w2_input_scale,
                                                                                     scales_want[1])
        gate = [tensors[f"{checkpoint_name(model, name + '.experts')}.{e}.{FAMILIES[family][0]}.input_scale"]
                for e in range(len(scales_want[0]))]
        gate_larger.extend((torch.stack(gate).float().reshape(-1) == scales_want[0]).tolist())
        extra = (None,) if kind == "autofp8" else ()  # FP8's block argument: per channel
        for tokens, traced_as in ((9, dense), (1, gathered)):
            x = torch.randn(tokens, cfg.hidden_size, generator=g) * 3  # some inputs saturate
            ids, weights = moe.route(x)
            args = (x, *weights_want, *extra, ids, weights, moe.act)
            assert torch.equal(experts(x, ids, weights, moe.act), grouped(*args, input_scales=scales_want))
            torch._dynamo.reset()
            traced = torch.compile(lambda x, e=experts, ids=ids, w=weights, act=moe.act: e(x, ids, w, act),
                                   backend="eager", fullgraph=True)(x)
            if tokens * ids.shape[1] >= experts.w13_q.shape[0]:
                traced_as = dense
            assert torch.equal(traced, traced_as(*args, input_scales=scales_want))
    # Gate and up scales differ either way round here: the fused input takes the larger of each pair.
    assert any(gate_larger) and not all(gate_larger)


@pytest.mark.parametrize("kind", list(KINDS))
def test_two_ranks_static_experts_sum_to_one_ranks(kind: str, static_moe) -> None:
    """Every rank quantizes by the same scales, so its gate/up rows and its slice of the
    intermediate carry the one-rank layer's codes: int8's integer sums make the ranks' outputs sum
    to the one-rank output within float32's roundings of the scaled sums; FP8's float32 sums in
    another order may still move an intermediate code one step (2^-3 of it) through |W2|."""
    cfg = ModelConfig.from_hf(static_moe["qwen3_moe", kind])
    full = load_model(cfg, torch.float32, "cpu")[0]
    ranks = [load_model(cfg, torch.float32, "cpu", TPGroup(r, 2), tp_layout(cfg, r, 2))[0] for r in range(2)]
    x = torch.randn(6, cfg.hidden_size, generator=torch.Generator().manual_seed(8)) * 3
    name, moe = _moe_layers(full)[0]
    ids, weights = moe.route(x)
    want = moe.experts(x, ids, weights, moe.act).double()
    parts = [m.get_submodule(name).experts for m in ranks]
    assert all(p.w13_q.shape[1] == moe.experts.w13_q.shape[1] // 2 for p in parts)
    assert all(torch.equal(p.w13_input_scale, moe.experts.w13_input_scale) for p in parts)
    got = sum(p(x, ids, weights, moe.act).double() for p in parts)
    scale = want.abs().max()
    assert ((got - want).abs() <= (2.0**-3 if kind == "autofp8" else 1e-5) * scale).all()
    assert not torch.equal(got, torch.zeros_like(got))


def _transformers_static_fp8(deq: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor] | None) -> torch.Tensor:
    """transformers' float Llama with the dequantized weights, each projection's input quantized
    by its static scale and back (x / s clamped to +-448, rounded to e4m3, times s; `inputs`
    None: float activations)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(SOURCE, dtype=torch.float32).eval()
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n}
    assert len(linears) == 14

    def hook(s: torch.Tensor):
        def quantize(mod, inputs):
            x = inputs[0]
            return ((x / s).clamp(-448, 448).to(torch.float8_e4m3fn).to(x.dtype) * s,)
        return quantize

    for n, m in linears.items():
        m.weight.copy_(deq[f"{n}.weight"])
        if inputs is not None:
            m.register_forward_pre_hook(hook(inputs[n]))
    return model(PROMPT[None]).logits[0]


def test_static_fp8_dense_logits_are_transformers_with_its_input_scales(tmp_path) -> None:
    """AutoFP8's static FP8 on a dense Llama (projections: `Fp8Linear` with per-tensor weight and
    input scales; q/k/v and gate/up calibrated on one input share a scale): the logits of
    transformers' float model quantizing each projection's input by its scale, to float32's
    reordering (1e-4 of the largest logit, as test_quantized_checkpoints.py), and far from the
    same weights with float activations."""
    path = tmp_path / "autofp8"
    deq, inputs = write_static_checkpoint(SOURCE, path, "autofp8")
    cfg = ModelConfig.from_hf(path)
    model = load_model(cfg, torch.float32, "cpu")[0]
    fp8 = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert len(fp8) == 2 * 4 and all(m.input_scale is not None and m.block is None for m in fp8)
    assert not any(isinstance(m, Int8Linear) for m in model.modules())
    from batonlm.model_runner.forward_batch import ForwardBatch
    from batonlm.model_runner.model_runner import ModelRunner

    runner = ModelRunner(cfg, dtype=torch.float32, device="cpu", kv_capacity=64, num_req_slots=4, context_length=64,
                         attention_backend="torch", sampler="torch")
    runner.model = model
    n = PROMPT.numel()
    batch = ForwardBatch.build(torch.arange(1, n + 1), [1], [0], [n], "cpu", input_ids=PROMPT)
    ours = runner.model.logits(runner.forward_hidden(batch)[1])
    want = _transformers_static_fp8(deq, inputs)
    bound = 1e-4 * want.abs().max()
    assert (ours - want).abs().max() <= bound
    assert (ours - _transformers_static_fp8(deq, None)).abs().max() > 100 * bound
