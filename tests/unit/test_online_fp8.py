"""`--quantization fp8` on a float checkpoint ("online" FP8): each decoder projection rounded to
FP8 e4m3 with one scale per output channel as it is read. On the CPU the rounded weights are
dequantized into the model dtype (W8A16); kept resident (CUDA's default: half the bytes of
bfloat16) each projection is an `Fp8Linear` whose inputs are quantized to FP8 per token, the
W8A8 dynamic scheme other engines run online FP8 with.

References, in float32 through transformers: the float model with every projection's weight
replaced by its per-channel rounding (W8A16), and that model with each projection's input
quantized to FP8 per token and back (scale = amax / 448), as Fp8Linear computes. Bound: the same
float32 math in another order, 1e-4 of the largest logit (test_quantized_checkpoints.py says
why).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from batonlm.model_runner.forward_batch import ForwardBatch
from batonlm.model_runner.model_config import ModelConfig
from batonlm.model_runner.model_loader import load_model
from batonlm.model_runner.quantization.dequantized import fp8_round_per_channel
from batonlm.model_runner.quantization.linear import Fp8Linear
from batonlm.model_runner.weight_size import held_tensors, weight_bytes

SOURCE = Path(__file__).resolve().parents[1] / "data" / "quantized" / "fp32-source"
RELATIVE = 1e-4
PROMPT = torch.tensor([1, 403, 407, 261, 378, 32, 45, 290])
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


def _transformers(activations: bool) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(SOURCE, dtype=torch.float32).eval()
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n}
    assert len(linears) == 14
    with torch.no_grad():
        for m in linears.values():
            m.weight.copy_(fp8_round_per_channel(m.weight))

    def per_token_fp8(mod, inputs):
        x = inputs[0]
        s = (x.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
        return ((x / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(x.dtype) * s,)

    if activations:
        for m in linears.values():
            m.register_forward_pre_hook(per_token_fp8)
    with torch.no_grad():
        return model(PROMPT[None]).logits[0]


def _ours(resident: bool | None) -> tuple[torch.Tensor, torch.nn.Module]:
    cfg = ModelConfig.from_hf(SOURCE, quantization="fp8")
    model = load_model(cfg, torch.float32, "cpu", resident=resident)[0]
    from batonlm.model_runner.model_runner import ModelRunner

    runner = ModelRunner(cfg, dtype=torch.float32, device="cpu", kv_capacity=64, num_req_slots=4, context_length=64,
                         attention_backend="torch", sampler="torch")
    runner.model = model
    n = PROMPT.numel()
    batch = ForwardBatch.build(torch.arange(1, n + 1), [1], [0], [n], "cpu", input_ids=PROMPT)
    _, hidden = runner.forward_hidden(batch)
    return runner.model.logits(hidden), model


@pytest.mark.parametrize("resident", [None, True])
def test_online_fp8_logits(resident: bool | None) -> None:
    """On the CPU by default: the rounded weights (no Fp8Linear); resident: Fp8Linear for every
    projection, with per-token FP8 activations. Each within the bound of its reference and, the
    two references being far apart, outside the other's."""
    ours, model = _ours(resident)
    fp8 = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert len(fp8) == (0 if resident is None else 8)  # qkv, o, gate_up, down in each of 2 layers
    assert all(m.block is None and m.input_scale is None and m.weight_q.dtype == torch.float8_e4m3fn for m in fp8)
    want, other = _transformers(activations=bool(resident)), _transformers(activations=not resident)
    bound = RELATIVE * want.abs().max()
    assert (ours - want).abs().max() <= bound
    assert (ours - other).abs().max() > 100 * bound


def test_resident_online_fp8_holds_a_byte_per_weight() -> None:
    """What a GPU's KV budget counts is what the resident model holds: FP8 projections with a
    float32 scale per row, about half the bytes of bfloat16 ones."""
    cfg = ModelConfig.from_hf(SOURCE, quantization="fp8")
    model = load_model(cfg, torch.bfloat16, "cpu", resident=True)[0]
    held = sum(t.numel() * t.element_size() for t in held_tensors(model))
    assert weight_bytes(cfg, torch.bfloat16, device="cuda", resident=True) == held
    projections = 2 * (256 * 512 + 256 * 256 + 2 * 256 * 384 + 384 * 256)  # 2 layers' q/k/v, o, gate/up, down
    float_cfg = ModelConfig.from_hf(SOURCE)
    assert weight_bytes(float_cfg, torch.bfloat16, device="cuda") - held == projections - 4 * 2 * (512 + 256 + 768 + 256)


def test_which_checkpoints_stay_quantized_by_default() -> None:
    from batonlm.model_runner.model_loader import keeps_quantized

    data = SOURCE.parent
    online = ModelConfig.from_hf(SOURCE, quantization="fp8")
    assert not keeps_quantized(online, "cpu")  # W8A16 on the CPU: float speed, as measured
    # On CUDA only where FP8 multiplies (capability 8.9+); without a GPU, never.
    assert keeps_quantized(online, "cuda") == (torch.cuda.is_available()
                                               and torch.cuda.get_device_capability() >= (8, 9))
    assert not keeps_quantized(ModelConfig.from_hf(SOURCE), "cuda")  # nothing to keep
    for w8a8 in ("w8a8", "fp8-dynamic"):  # activations quantized as the checkpoint says, everywhere
        assert keeps_quantized(ModelConfig.from_hf(data / w8a8), "cpu")
    assert not keeps_quantized(ModelConfig.from_hf(data / "w4a16"), "cpu")
    assert keeps_quantized(ModelConfig.from_hf(data / "w4a16"), "cuda")
