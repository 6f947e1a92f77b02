"""Quantized checkpoints written by the tools users quantize with (tests/data/quantized/README.md:
llm-compressor, GPTQModel; two by tests/quant_formats.py) load, and give the logits of what they
mean: transformers' own quantized inference where it computes that exactly (compressed-tensors,
including W8A8's activation quantization, FP8 and int8), the dequantized float32 model where transformers'
kernels round (GPTQ and AWQ run in float16 there; their weights are read back by
quant_formats.py's readers, checked against GPTQModel's and AutoAWQ's own code).

Bound: the same float32 math in another order. Each logit is a chain of two layers of dot products
of K <= 384 terms; float32 summation errs by at most ~K * 2^-24 of the sum of |terms| per dot
product, ~2.3e-5 relative, compounded over a handful of them: 1e-4 of the largest logit (~13).
A quantized activation (W8A8) whose value lies at a rounding tie can round the other way in
the other order; none does on this prompt (transformers agrees to the bound).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from quant_formats import dequantize_awq, dequantize_gptq, save_dequantized
from safetensors import safe_open
from safetensors.torch import load_file

from batonlm.kernels.input_quant import INPUT_QUANTS
from batonlm.model_runner.forward_batch import ForwardBatch
from batonlm.model_runner.model_config import ModelConfig
from batonlm.model_runner.model_runner import ModelRunner
from batonlm.model_runner.moe import Fp8Experts
from batonlm.model_runner.quantization.linear import Fp8Linear, Int8Linear, LlmInt8Linear, PackedIntLinear

DATA = Path(__file__).resolve().parents[1] / "data" / "quantized"
# transformers (+ compressed-tensors) computes exactly what these mean.
TRANSFORMERS_EXACT = ("fp8-dynamic", "fp8-block", "w4a16", "w4a16-asym", "w4a16-gptq", "w8a16", "w8a8", "w8a8-static",
                      "w8a8-asym", "w8a8-static-asym", "w4afp8", "w4a8")
GPTQ_AWQ = ("gptqmodel-w4g64", "gptqmodel-w4g64-asym-descact", "gptq-w4g64", "gptqmodel-awq-w4g64", "awq-w4g64")
RELATIVE = 1e-4


def _runner(path: Path | str, resident: bool | None = None) -> ModelRunner:
    cfg = ModelConfig.from_hf(path)
    runner = ModelRunner(cfg, dtype=torch.float32, device="cpu", kv_capacity=64, num_req_slots=4,
                         context_length=64, attention_backend="torch", sampler="torch")
    if resident is not None:  # the same checkpoint loaded the other way
        from batonlm.model_runner.model_loader import load_model

        runner.model = load_model(cfg, torch.float32, "cpu", resident=resident)[0]
    return runner


def _prompt_logits(runner: ModelRunner, ids: torch.Tensor) -> torch.Tensor:
    n = ids.numel()
    batch = ForwardBatch.build(torch.arange(1, n + 1), [1], [0], [n], "cpu", input_ids=ids)
    _, hidden = runner.forward_hidden(batch)
    return runner.model.logits(hidden)


def _reference(name: str) -> dict[str, torch.Tensor]:
    return load_file(str(DATA / name / "reference.safetensors"))


@pytest.mark.parametrize("name", TRANSFORMERS_EXACT)
def test_compressed_tensors_checkpoints_give_transformers_logits(name: str) -> None:
    ref = _reference(name)
    ours = _prompt_logits(_runner(DATA / name), ref["input_ids"].reshape(-1))
    assert (ours - ref["logits"]).abs().max() <= RELATIVE * ref["logits"].abs().max()


@pytest.mark.parametrize("name", ["w4a16", "w4a16-asym", "w4a16-gptq", "w8a16"])
def test_weight_only_checkpoints_kept_packed_give_transformers_logits(name: str) -> None:
    """Kept in their codes (CUDA's default; here the kernels' torch references): int4, and
    8-bit (W8A16: 4 codes per word) alike, transformers' logits."""
    ref = _reference(name)
    runner = _runner(DATA / name, resident=True)
    assert any(isinstance(m, PackedIntLinear) for m in runner.model.modules())
    ours = _prompt_logits(runner, ref["input_ids"].reshape(-1))
    assert (ours - ref["logits"]).abs().max() <= RELATIVE * ref["logits"].abs().max()


@pytest.mark.parametrize("name, fake", [("w4afp8", "fp8"), ("w4a8", "int8")])
def test_int4_weights_with_quantized_inputs_stay_packed_and_quantize_them(name: str, fake: str) -> None:
    """llm-compressor's W4AFP8 / W4A8 (int4 values in an int8 `weight` per group of 128, inputs FP8
    / int8 per token): packed int4 layers that quantize their inputs and back first, transformers'
    logits (above); run on float inputs, as they ran before, the logits are over 100x the bound off
    (2800x / 1000x here)."""
    ref = _reference(name)
    ids = ref["input_ids"].reshape(-1)
    runner = _runner(DATA / name)
    layers = [m for m in runner.model.modules() if isinstance(m, PackedIntLinear)]
    assert len(layers) == 8 and all(m.input_fake_quant is not None and m.group_size == 128 for m in layers)
    for m in layers:
        m.input_fake_quant = None
    bound = RELATIVE * ref["logits"].abs().max()
    assert (_prompt_logits(runner, ids) - ref["logits"]).abs().max() > 100 * bound
    assert {m.input_fake_quant for m in _runner(DATA / name).model.modules() if isinstance(m, PackedIntLinear)} == \
        {INPUT_QUANTS[fake]}


@pytest.mark.parametrize("desc_act", [False, True])
def test_gptq_8_bit_kept_packed_gives_the_dequantized_models_logits(desc_act: bool, tmp_path: Path) -> None:
    """GPTQ 8-bit (AutoGPTQ / GPTQModel `bits: 8`), asymmetric, in activation order too: kept in
    8-bit codes, the dequantized float32 model's logits."""
    from quant_formats import write_gptq_checkpoint

    gptq = tmp_path / "gptq8"
    def shared_order(name: str) -> str:  # GPTQ orders the projections of one input together
        return re.sub(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.weight$", ".input", name)

    deq = write_gptq_checkpoint(DATA / "fp32-source", gptq, bits=8, group_size=64, sym=False, desc_act=desc_act,
                                order_key=shared_order)
    save_dequantized(gptq, deq, tmp_path / "float")
    ids = _reference("fp32-source")["input_ids"].reshape(-1)
    want = _prompt_logits(_runner(tmp_path / "float"), ids)
    runner = _runner(gptq, resident=True)
    layers = [m for m in runner.model.modules() if isinstance(m, PackedIntLinear)]
    assert len(layers) == 8 and all(m.bits == 8 and (m.g_idx is not None) == desc_act for m in layers)
    ours = _prompt_logits(runner, ids)
    assert (ours - want).abs().max() <= RELATIVE * want.abs().max()


def _weight_only_int8(tmp: Path, group: int | None) -> Path:
    """The `w8a8` fixture's int8 weights read weight-only (compressed-tensors int-quantized
    without input activations: W8A16); `group`: instead, every weight re-quantized asymmetric
    per group of `group` input features (int8 codes, a scale and an int8 zero point per group)."""
    import json
    import shutil

    from safetensors.torch import save_file

    out = tmp / f"int8-weight-only-{group}"
    shutil.copytree(DATA / "w8a8", out)
    config = json.loads((out / "config.json").read_text())
    scheme = config["quantization_config"]["config_groups"]["group_0"]
    scheme["input_activations"] = None
    tensors = load_file(str(out / "model.safetensors"))
    if group is not None:
        scheme["weights"].update(strategy="group", group_size=group, symmetric=False)
        float_ones = load_file(str(DATA / "fp32-source" / "model.safetensors"))
        for name in [n for n in tensors if n.endswith(".weight_scale")]:
            p = name.removesuffix(".weight_scale")
            w = float_ones[p + ".weight"].reshape(-1, group)  # [N * K / group, group]
            lo, hi = w.amin(dim=1, keepdim=True).clamp(max=0), w.amax(dim=1, keepdim=True).clamp(min=0)
            scale = ((hi - lo) / 255).clamp(min=1e-8)
            zero = (torch.round(-lo / scale) - 128).clamp(-128, 127)
            q = (torch.round(w / scale) + zero).clamp(-128, 127)
            n = float_ones[p + ".weight"].shape[0]
            tensors[p + ".weight"] = q.to(torch.int8).view(n, -1)
            tensors[name] = scale.view(n, -1).to(torch.bfloat16)
            tensors[p + ".weight_zero_point"] = zero.to(torch.int8).view(n, -1)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("group", [None, 64])
def test_weight_only_int8_kept_packed_gives_its_dequantized_logits(group: int | None, tmp_path: Path) -> None:
    """Unpacked int8 weights whose activations are not int8 (W8A16, per channel; or asymmetric
    per group with zero points) join the 8-bit packed layout where weight-only formats stay
    quantized: the dequantized model's logits (the loader's float view of the same codes)."""
    path = _weight_only_int8(tmp_path, group)
    ids = _reference("w8a8")["input_ids"].reshape(-1)
    want = _prompt_logits(_runner(path, resident=False), ids)
    runner = _runner(path, resident=True)
    layers = [m for m in runner.model.modules() if isinstance(m, PackedIntLinear)]
    assert len(layers) == 8 and all(m.bits == 8 for m in layers)
    assert not any(isinstance(m, Int8Linear) for m in runner.model.modules())
    ours = _prompt_logits(runner, ids)
    assert (ours - want).abs().max() <= RELATIVE * want.abs().max()
    # The W8A8 checkpoint itself (int8 activations) keeps its int8 kernels, not the packed layout.
    assert not any(isinstance(m, PackedIntLinear) for m in _runner(DATA / "w8a8", resident=True).model.modules())


def test_unpacked_int8_in_activation_order_gives_the_weights_it_means(tmp_path: Path) -> None:
    """Unpacked int8 weights per group with `weight_g_idx` (each input row's group, here a random
    assignment of 64 rows to each, one per input as GPTQ orders the layers that read it):
    W[n, k] = (code - zero[n, g(k)]) * scale[n, g(k)]. Written
    out in float32 by the test from that definition, that model's logits are what the loader
    gives, dequantized (the CPU's default) and kept packed with the row groups (CUDA's); reading
    the groups as consecutive rows is far off."""
    from safetensors.torch import save_file

    path = _weight_only_int8(tmp_path, 64)
    tensors = load_file(str(path / "model.safetensors"))
    deq: dict[str, torch.Tensor] = {}
    g = torch.Generator().manual_seed(3)
    orders: dict[str, torch.Tensor] = {}
    for name in sorted(n for n in tensors if n.endswith(".weight_scale")):
        p = name.removesuffix(".weight_scale")
        q, scale, zero = tensors[p + ".weight"], tensors[name], tensors[p + ".weight_zero_point"]
        k = q.shape[1]
        key = re.sub(r"(q|k|v|gate|up)_proj$", "input", p)  # the layers of one input share its order
        groups = orders.setdefault(key, (torch.randperm(k, generator=g) // 64).to(torch.int32))
        tensors[p + ".weight_g_idx"] = groups.clone()
        gl = groups.long()
        deq[p + ".weight"] = ((q.double() - zero.double()[:, gl]) * scale.double()[:, gl]).float()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    truth = tmp_path / "truth"
    save_dequantized(path, deq, truth)
    ids = _reference("w8a8")["input_ids"].reshape(-1)
    want = _prompt_logits(_runner(truth), ids)
    for resident in (False, True):
        runner = _runner(path, resident=resident)
        packed = [m for m in runner.model.modules() if isinstance(m, PackedIntLinear)]
        assert len(packed) == (8 if resident else 0) and all(m.g_idx is not None for m in packed)
        assert (_prompt_logits(runner, ids) - want).abs().max() <= RELATIVE * want.abs().max(), resident
    consecutive = {n: t for n, t in tensors.items() if not n.endswith(".weight_g_idx")}
    save_file(consecutive, str(path / "model.safetensors"), metadata={"format": "pt"})
    assert (_prompt_logits(_runner(path), ids) - want).abs().max() > 100 * RELATIVE * want.abs().max()


# AutoGPTQ's quantize_config.json (as TheBloke's GPTQ repositories have it, no quant_method) and
# AutoAWQ's quant_config.json.
AUTOGPTQ_FILE = {"bits": 4, "group_size": 64, "damp_percent": 0.01, "desc_act": False, "sym": True,
                 "true_sequential": True, "model_name_or_path": None, "model_file_base_name": "model"}
AUTOAWQ_FILE = {"zero_point": True, "q_group_size": 64, "w_bit": 4, "version": "GEMM"}


@pytest.mark.parametrize("name, file, written", [
    ("gptqmodel-w4g64", "quantize_config.json", None),  # GPTQModel's own file (it names quant_method)
    ("gptq-w4g64", "quantize_config.json", AUTOGPTQ_FILE),
    ("awq-w4g64", "quant_config.json", AUTOAWQ_FILE),
    ("modelopt-nvfp4", "hf_quant_config.json", None),  # ModelOpt's own file (older nvidia repositories: only it)
    ("modelopt-mixed", "hf_quant_config.json", None),  # (its quantized_layers there under `quantization`)
])
def test_a_quantize_config_file_beside_the_weights_is_read(name: str, file: str, written: dict | None,
                                                           tmp_path: Path) -> None:
    """A GPTQ / AWQ / ModelOpt checkpoint whose config.json has no quantization_config (older ones
    kept it in AutoGPTQ's, AutoAWQ's or ModelOpt's own file beside the weights) loads as the one
    whose config.json has it: the same quantization, the same logits."""
    import json
    import shutil

    out = tmp_path / name
    shutil.copytree(DATA / name, out)
    config = json.loads((out / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    if written is not None:
        (out / file).write_text(json.dumps(written))
    assert (out / file).is_file()
    assert ModelConfig.from_hf(out).quantization == ModelConfig.from_hf(DATA / name).quantization
    ids = _reference(name)["input_ids"].reshape(-1)
    assert torch.equal(_prompt_logits(_runner(out), ids), _prompt_logits(_runner(DATA / name), ids))
    (out / file).write_text(json.dumps({"damp_percent": 0.01}))
    with pytest.raises(ValueError, match=f"{file} names no quant_method"):
        ModelConfig.from_hf(out)


@pytest.mark.parametrize("layout", ["config", "hf_quant_config"])
def test_modelopt_fp8_is_the_static_fp8_it_stores(layout: str, tmp_path: Path) -> None:
    """NVIDIA ModelOpt's FP8 checkpoints store what AutoFP8's static ones do (an FP8 weight with a
    scale per tensor, a static `input_scale` per layer): declared in config.json's
    quantization_config (`quant_method: modelopt, quant_algo: FP8`) or, in its older layout, in
    hf_quant_config.json beside the weights, they load as the AutoFP8 checkpoint of the same
    tensors, bit for bit; an algorithm batonlm does not run is named at start-up."""
    import json
    import shutil

    from quant_w8a8 import write_static_checkpoint

    autofp8 = tmp_path / "autofp8"
    write_static_checkpoint(DATA / "fp32-source", autofp8, "autofp8")
    out = tmp_path / "modelopt"
    shutil.copytree(autofp8, out)
    config = json.loads((out / "config.json").read_text())
    algo = {"quant_algo": "FP8", "kv_cache_quant_algo": None}
    if layout == "config":
        config["quantization_config"] = {"quant_method": "modelopt", **algo, "ignore": ["lm_head"]}
    else:
        del config["quantization_config"]
        (out / "hf_quant_config.json").write_text(json.dumps(
            {"producer": {"name": "modelopt", "version": "0.19.0"}, "quantization": {**algo, "exclude_modules": ["lm_head"]}}))
    (out / "config.json").write_text(json.dumps(config))
    quant = ModelConfig.from_hf(out).quantization
    assert quant is not None and quant.description == "modelopt fp8 (per tensor, static activation scales)"
    runner = _runner(out)
    layers = [m for m in runner.model.modules() if isinstance(m, Fp8Linear)]
    assert len(layers) == 8 and all(m.input_scale is not None and m.block is None for m in layers)
    ids = _reference("fp32-source")["input_ids"].reshape(-1)
    assert torch.equal(_prompt_logits(runner, ids), _prompt_logits(_runner(autofp8), ids))
    bad = {"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"}
    if layout == "config":
        config["quantization_config"] = bad
        (out / "config.json").write_text(json.dumps(config))
    else:
        (out / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "W4A8_AWQ"}}))
    with pytest.raises(ValueError, match=r"modelopt quant_algo 'W4A8_AWQ' is not supported \(supported: FP8, "
                                         r"FP8_PER_CHANNEL_PER_TOKEN, FP8_PB_WO, MXFP8, NVFP4, NVFP4_AWQ, W4A16_AWQ, W4A16_NVFP4, W8A16, "
                                         r"MIXED_PRECISION\)"):
        ModelConfig.from_hf(out)


def test_modelopt_fp8_per_channel_per_token_is_fp8_dynamic(tmp_path: Path) -> None:
    """ModelOpt's FP8_PER_CHANNEL_PER_TOKEN stores llm-compressor's FP8_DYNAMIC tensors (a scale
    per output channel, no activation scale): the `fp8-dynamic` fixture declared so gives the
    fixture's logits (transformers', to the bound) bit for bit."""
    import json
    import shutil

    out = tmp_path / "modelopt-channel"
    shutil.copytree(DATA / "fp8-dynamic", out)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "FP8_PER_CHANNEL_PER_TOKEN"}
    (out / "config.json").write_text(json.dumps(config))
    quant = ModelConfig.from_hf(out).quantization
    assert quant is not None and quant.description == "modelopt fp8 (per channel, dynamic activations)"
    ids = _reference("fp8-dynamic")["input_ids"].reshape(-1)
    assert torch.equal(_prompt_logits(_runner(out), ids), _prompt_logits(_runner(DATA / "fp8-dynamic"), ids))


def test_a_modelopt_kv_cache_only_config_leaves_the_weights_float(tmp_path: Path) -> None:
    """ModelOpt quantizing the KV cache alone (`quant_algo` null, `kv_cache_quant_algo` FP8): the
    weights are float, in config.json's layout and in hf_quant_config.json's."""
    import json
    import shutil

    out = tmp_path / "kv-only"
    shutil.copytree(DATA / "fp32-source", out)
    (out / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": None,
                                                                           "kv_cache_quant_algo": "FP8"}}))
    assert ModelConfig.from_hf(out).quantization is None
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": None, "kv_cache_quant_algo": "FP8"}
    (out / "config.json").write_text(json.dumps(config))
    assert ModelConfig.from_hf(out).quantization is None
    ids = _reference("fp32-source")["input_ids"].reshape(-1)
    assert torch.equal(_prompt_logits(_runner(out), ids), _prompt_logits(_runner(DATA / "fp32-source"), ids))


@pytest.mark.parametrize("name", ["bnb-nf4", "bnb-fp4"])
@pytest.mark.parametrize("resident", [False, True])
def test_bitsandbytes_4_bit_checkpoints_give_the_weights_bitsandbytes_dequantizes(name: str, resident: bool) -> None:
    """transformers' BitsAndBytesConfig(load_in_4bit) checkpoints (NF4 with double quantization,
    FP4 without; written by transformers 5.25 + bitsandbytes 0.50 on the CPU), dequantized on
    load (the CPU's default) or kept packed with their codebook (CUDA's; here the kernels' torch
    references): the logits of the float32 model of bitsandbytes' own `dequantize_4bit` weights
    (the fixture's `dequantized_logits`), to the float32 bound, and transformers' greedy tokens
    (whose CPU 4-bit matmul is not that product: its logits are 0.4 off it)."""
    ref = _reference(name)
    ids = ref["input_ids"].reshape(-1)
    quant = ModelConfig.from_hf(DATA / name).quantization
    assert quant is not None and quant.description == "bitsandbytes 4-bit"
    runner = _runner(DATA / name, resident=resident)
    packed = [m for m in runner.model.modules() if isinstance(m, PackedIntLinear)]
    assert len(packed) == (8 if resident else 0)  # 2 layers' q/k/v, o, gate/up, down: 4-bit with the codebook
    assert all(m.bits == 4 and m.zeros is None and m.codebook is not None and m.group_size == 64 for m in packed)
    ours = _prompt_logits(runner, ids)
    want = ref["dequantized_logits"]
    assert (ours - want).abs().max() <= RELATIVE * want.abs().max()
    assert ours.argmax(dim=-1)[-1] == ref["greedy_ids"][0]
    if resident:  # the codebook is the checkpoint's, read code by code: NF4's read as FP4's is far off
        table = load_file(str(DATA / ("bnb-fp4" if name == "bnb-nf4" else "bnb-nf4") / "model.safetensors"))
        for m in packed:
            assert m.codebook is not None
            m.codebook.copy_(table["model.layers.0.mlp.down_proj.weight.quant_map"])
            m.finish_load()  # (on the CPU the layer keeps the weight its table and codes mean)
        assert (_prompt_logits(runner, ids) - want).abs().max() > 100 * RELATIVE * want.abs().max()


def _assert_nvfp4_bytes(packed: list[PackedIntLinear]) -> None:
    """NVFP4 kept packed holds its float8 group scales as they are: half a byte per code, one
    byte per 16 weights, and one float32 factor per output column (0.5625 bytes a weight)."""
    for m in packed:
        assert m.scales.dtype == torch.float8_e4m3fn and m.scale_2 is not None
        held = sum(t.numel() * t.element_size() for t in (m.qweight, m.scales, m.scale_2))
        assert held == m.n * m.k // 2 + m.n * m.k // 16 + 4 * m.n


@pytest.mark.parametrize("resident", [False, True])
def test_nvfp4_weights_give_the_dequantized_models_logits(resident: bool) -> None:
    """llm-compressor's NVFP4A16 (FP4 E2M1 codes, an FP8 scale per 16 inputs, a global scale),
    dequantized on load (the CPU's default) or kept packed with the E2M1 table in groups of 16
    (CUDA's): the float32 model of the weights the format means (the fixture's
    `dequantized_logits`, read by make_references.py from the format's description) to the
    float32 bound, and transformers' greedy tokens (transformers runs it in bfloat16 only:
    compressed-tensors decompresses NVFP4 to bfloat16; its logits are 0.32 off)."""
    ref = _reference("nvfp4a16")
    ids = ref["input_ids"].reshape(-1)
    runner = _runner(DATA / "nvfp4a16", resident=resident)
    packed = [m for m in runner.model.modules() if isinstance(m, PackedIntLinear)]
    assert len(packed) == (8 if resident else 0)
    assert all(m.codebook is not None and m.group_size == 16 and m.zeros is None for m in packed)
    _assert_nvfp4_bytes(packed)
    ours = _prompt_logits(runner, ids)
    want = ref["dequantized_logits"]
    assert (ours - want).abs().max() <= RELATIVE * want.abs().max()
    assert ours.argmax(dim=-1)[-1] == ref["greedy_ids"][0]


@pytest.mark.parametrize("resident", [False, True])
def test_mxfp4_weights_give_the_dequantized_models_logits(resident: bool) -> None:
    """llm-compressor's MXFP4A16 (FP4 E2M1 codes, an E8M0 exponent per 32 inputs), dequantized on
    load or kept packed with the E2M1 table in groups of 32: the float32 model of the weights the
    format means (`dequantized_logits`, decoded by make_references.py) to the float32 bound.
    (transformers runs it in bfloat16 only, 0.26 off, its greedy tokens not the float32 model's
    at a near tie.)"""
    ref = _reference("mxfp4a16")
    ids = ref["input_ids"].reshape(-1)
    quant = ModelConfig.from_hf(DATA / "mxfp4a16").quantization
    assert quant is not None and quant.description == "compressed-tensors (MXFP4 weights)"
    runner = _runner(DATA / "mxfp4a16", resident=resident)
    packed = [m for m in runner.model.modules() if isinstance(m, PackedIntLinear)]
    assert len(packed) == (8 if resident else 0) and all(m.group_size == 32 and m.codebook is not None for m in packed)
    assert all(m.scales.dtype == torch.uint8 for m in packed)  # its E8M0 exponents, 1 byte per 32 weights
    want = ref["dequantized_logits"]
    assert (_prompt_logits(runner, ids) - want).abs().max() <= RELATIVE * want.abs().max()


def test_mxfp4_activations_are_quantized_as_compressed_tensors_does() -> None:
    """llm-compressor's MXFP4 (the MXFP4A16 fixture's weights, byte for byte, with MXFP4 inputs:
    E8M0 scales per 32 computed per token): packed E2M1 layers that quantize each input so and
    back (kernels/mxfp4.py): the float32 model with compressed-tensors' own `fake_quantize` on every
    layer's input (`dequantized_logits`, make_references.py) bit for bit here (the test holds the
    float32 bound); without the input quantization far off. (transformers runs it in bfloat16
    only: 10.4 off, its FP4 inputs magnifying bfloat16's rounding.)"""
    from batonlm.kernels.mxfp4 import ct_mxfp4_fake_quant

    ref = _reference("mxfp4")
    ids = ref["input_ids"].reshape(-1)
    cfg = ModelConfig.from_hf(DATA / "mxfp4")
    assert cfg.quantization is not None and cfg.quantization.description == "compressed-tensors (MXFP4 weights and activations)"
    runner = _runner(DATA / "mxfp4")
    packed = [m for m in runner.model.modules() if isinstance(m, PackedIntLinear)]
    assert len(packed) == 8 and all(m.input_fake_quant is ct_mxfp4_fake_quant and m.group_size == 32 for m in packed)
    want = ref["dequantized_logits"]
    bound = RELATIVE * want.abs().max()
    assert (_prompt_logits(runner, ids) - want).abs().max() <= bound
    for m in packed:
        m.input_fake_quant = None  # the MXFP4A16 model
    assert (_prompt_logits(runner, ids) - want).abs().max() > 100 * bound


@pytest.mark.parametrize("name, description, greedy", [
    ("nvfp4", "compressed-tensors (NVFP4 weights and activations)", False),
    ("modelopt-nvfp4", "modelopt (NVFP4 weights and activations)", True),
])
def test_nvfp4_w4a4_quantizes_its_activations_as_its_tool_does(name: str, description: str, greedy: bool) -> None:
    """llm-compressor's NVFP4 (W4A4: FP4 activations per token and 16 inputs, with each layer's
    calibrated input global scale) and ModelOpt's NVFP4 export (as nvidia's *-FP4 repositories:
    each layer's `input_scale`) run packed on every device, their inputs quantized as the tool's
    own functions quantize them: compressed-tensors' `fake_quantize` (the `nvfp4` fixture's
    `dequantized_logits`) and ModelOpt's `NVFP4QTensor` (the `modelopt-nvfp4` fixture's
    reference, and its greedy token) on every layer's input of the float32 model of the weights,
    to the float32 bound. Without the activations' quantization the logits are >100x that bound
    off. (transformers runs compressed-tensors' NVFP4 in bfloat16 only; FP4 activations magnify its
    rounding: its logits are 6.5 off and its greedy tokens differ. It has no ModelOpt loader.)"""
    ref = _reference(name)
    ids = ref["input_ids"].reshape(-1)
    quant = ModelConfig.from_hf(DATA / name).quantization
    assert quant is not None and quant.act_quant == "fp4" and quant.description == description
    runner = _runner(DATA / name)  # kept quantized on the CPU too: its activations are quantized
    packed = [m for m in runner.model.modules() if isinstance(m, PackedIntLinear)]
    assert len(packed) == 8 and all(m.fp4_input_scale is not None and m.group_size == 16 for m in packed)
    assert all(m.weight_f is not None for m in packed)  # (the CPU keeps the dequantized operand: the same values)
    ours = _prompt_logits(runner, ids)
    want = ref["dequantized_logits"]
    bound = RELATIVE * want.abs().max()
    assert (ours - want).abs().max() <= bound
    if greedy:
        assert ours.argmax(dim=-1)[-1] == ref["greedy_ids"][0]
    for m in packed:
        m.fp4_input_scale = None
    assert (_prompt_logits(runner, ids) - want).abs().max() > 100 * bound


@pytest.mark.parametrize("resident", [False, True])
def test_modelopt_w4a16_nvfp4_gives_modelopts_dequantized_weights_logits(resident: bool) -> None:
    """NVIDIA ModelOpt's W4A16_NVFP4 export (`weight` FP4 codes, float8 `weight_scale` per 16,
    `weight_scale_2`: W = value * (scale * scale_2)), dequantized on load or kept packed in groups
    of 16: the logits of the float32 model of the weights ModelOpt's own `NVFP4QTensor.dequantize`
    reads (the fixture's reference; transformers has no ModelOpt integration) to the float32 bound,
    and its greedy token."""
    ref = _reference("modelopt-w4a16-nvfp4")
    ids = ref["input_ids"].reshape(-1)
    quant = ModelConfig.from_hf(DATA / "modelopt-w4a16-nvfp4").quantization
    assert quant is not None and quant.description == "modelopt (NVFP4 weights)" and quant.act_quant == "none"
    runner = _runner(DATA / "modelopt-w4a16-nvfp4", resident=resident)
    packed = [m for m in runner.model.modules() if isinstance(m, PackedIntLinear)]
    assert len(packed) == (8 if resident else 0) and all(m.group_size == 16 and m.codebook is not None for m in packed)
    _assert_nvfp4_bytes(packed)
    ours = _prompt_logits(runner, ids)
    want = ref["logits"]
    assert (ours - want).abs().max() <= RELATIVE * want.abs().max()
    assert ours.argmax(dim=-1)[-1] == ref["greedy_ids"][0]


def test_modelopt_mixed_precision_runs_each_layer_as_its_algorithm_says() -> None:
    """ModelOpt's MIXED_PRECISION export (what `mtq.auto_quantize` writes: here FP8 attention and
    NVFP4 MLP layers, `quantized_layers` in hf_quant_config.json): each projection kept as its
    tensors say, FP8 with its static activation scale and NVFP4 with its FP4 activations, gives
    ModelOpt's own arithmetic's logits (the fixture's reference: its readers' weights, its
    `fp8_eager` and `NVFP4QTensor` on the layers' inputs) to the float32 bound, and its greedy
    token; without the FP4 activations' quantization >100x that bound off."""
    ref = _reference("modelopt-mixed")
    ids = ref["input_ids"].reshape(-1)
    quant = ModelConfig.from_hf(DATA / "modelopt-mixed").quantization
    assert quant is not None and quant.mixed == ("FP8", "NVFP4")
    assert quant.description == "modelopt mixed precision (FP8 and NVFP4 layers; activations quantized)"
    runner = _runner(DATA / "modelopt-mixed")
    fp8 = [m for m in runner.model.modules() if isinstance(m, Fp8Linear)]
    packed = [m for m in runner.model.modules() if isinstance(m, PackedIntLinear)]
    assert len(fp8) == 4 and all(m.input_scale is not None for m in fp8)  # q/k/v and o, per layer
    assert len(packed) == 4 and all(m.fp4_input_scale is not None for m in packed)  # gate/up and down
    ours = _prompt_logits(runner, ids)
    want = ref["logits"]
    bound = RELATIVE * want.abs().max()
    assert (ours - want).abs().max() <= bound
    assert ours.argmax(dim=-1)[-1] == ref["greedy_ids"][0]
    for m in packed:
        m.fp4_input_scale = None
    assert (_prompt_logits(runner, ids) - want).abs().max() > 100 * bound


def test_modelopt_nvfp4_awq_scales_the_inputs_before_their_fp4_quantization(tmp_path: Path) -> None:
    """ModelOpt's NVFP4_AWQ: NVFP4 W4A4 with AWQ's `pre_quant_scale` on the inputs its export did
    not fold away (here o_proj's and down_proj's, drawn in [0.5, 2]): each such layer multiplies
    its input by it, then quantizes that to FP4; the `modelopt-nvfp4` fixture's layers with their
    inputs so multiplied give the same logits bit for bit, and without the scales they differ."""
    import json
    import shutil

    from safetensors.torch import save_file

    out = tmp_path / "nvfp4-awq"
    shutil.copytree(DATA / "modelopt-nvfp4", out)
    tensors = load_file(str(out / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    scales = {}
    for layer in (0, 1):
        for proj, k in (("self_attn.o_proj", 256), ("mlp.down_proj", 384)):
            scales[f"model.layers.{layer}.{proj}"] = (0.5 + 1.5 * torch.rand(k, generator=g)).bfloat16()
    tensors.update({f"{p}.pre_quant_scale": v for p, v in scales.items()})
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "hf_quant_config.json"):
        text = (out / name).read_text()
        (out / name).write_text(text.replace('"NVFP4"', '"NVFP4_AWQ"'))
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_algo"] == "NVFP4_AWQ"
    ids = _reference("modelopt-nvfp4")["input_ids"].reshape(-1)
    got = _prompt_logits(_runner(out), ids)
    plain = _runner(DATA / "modelopt-nvfp4")
    assert not torch.equal(got, _prompt_logits(plain, ids))
    for prefix, scale in scales.items():
        module = plain.model.get_submodule(prefix.replace("self_attn.o_proj", "self_attn.o_proj.local")
                                           .replace("mlp.down_proj", "mlp.down_proj.local"))
        assert isinstance(module, PackedIntLinear) and module.fp4_input_scale is not None
        module.register_forward_pre_hook(lambda m, inputs, s=scale.float(): (inputs[0] * s.to(inputs[0].dtype),))
    assert torch.equal(got, _prompt_logits(plain, ids))


@pytest.mark.parametrize("change, words", [
    ({"model.layers.0.self_attn.k_proj.input_scale": torch.tensor(0.5)},
     ["model.layers.0.self_attn.qkv_proj", "input_scale differ"]),  # one fused input, one scale
    ({"model.layers.0.mlp.up_proj.weight_scale_2": None},
     ["model.layers.0.mlp.up_proj.weight", "no weight_scale_2"]),  # (else read as int8 codes)
])
def test_a_modelopt_nvfp4_layer_batonlm_cannot_run_is_named(change: dict, words: list[str], tmp_path: Path) -> None:
    import shutil

    from safetensors.torch import save_file

    from batonlm.model_runner.quantization.config import QuantizationError

    out = tmp_path / "bad"
    shutil.copytree(DATA / "modelopt-nvfp4", out)
    tensors = load_file(str(out / "model.safetensors"))
    changed = {k: v for k, v in {**tensors, **change}.items() if v is not None}  # (None: the tensor left out)
    save_file(changed, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(QuantizationError) as e:
        _runner(out)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_bitsandbytes_4_bit_in_another_storage_dtype_is_the_same_bytes(tmp_path: Path) -> None:
    """`bnb_4bit_quant_storage=bfloat16` (FSDP QLoRA's): the packed bytes saved seen as bfloat16
    give the uint8 checkpoint's logits bit for bit, dequantized and kept packed."""
    import json
    import shutil

    from safetensors.torch import save_file

    out = tmp_path / "bnb-nf4-bf16"
    shutil.copytree(DATA / "bnb-nf4", out)
    tensors = load_file(str(out / "model.safetensors"))
    for name in [n for n in tensors if n.endswith("proj.weight")]:
        tensors[name] = tensors[name].reshape(-1).view(torch.bfloat16).reshape(-1, 1)
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["bnb_4bit_quant_storage"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config))
    ids = _reference("bnb-nf4")["input_ids"].reshape(-1)
    for resident in (False, True):
        assert torch.equal(_prompt_logits(_runner(out, resident), ids), _prompt_logits(_runner(DATA / "bnb-nf4", resident), ids))


def test_bitsandbytes_8_bit_gives_transformers_llm_int8_logits() -> None:
    """transformers' BitsAndBytesConfig(load_in_8bit) checkpoint (LLM.int8, written by
    transformers 5.25 + bitsandbytes 0.50 on the CPU): int8 weights with row scales, run as
    bitsandbytes runs them on every device (`LlmInt8Linear`: int8 activations per row, the
    outlier columns, |x| >= 6, in float): transformers' logits to the float32 bound. The
    dequantized weights with float activations are 1.6 off, without the outlier columns 0.6:
    both far past the bound."""
    ref = _reference("bnb-int8")
    ids = ref["input_ids"].reshape(-1)
    quant = ModelConfig.from_hf(DATA / "bnb-int8").quantization
    assert quant is not None and quant.llm_int8_threshold == 6.0 and quant.act_quant == "int8"
    runner = _runner(DATA / "bnb-int8")  # kept quantized on every device: its activations are quantized
    layers = [m for m in runner.model.modules() if isinstance(m, LlmInt8Linear)]
    assert len(layers) == 8 and all(m.threshold == 6.0 for m in layers)
    ours = _prompt_logits(runner, ids)
    bound = RELATIVE * ref["logits"].abs().max()
    assert (ours - ref["logits"]).abs().max() <= bound
    assert ours.argmax(dim=-1)[-1] == ref["greedy_ids"][0]
    assert (ours - ref["dequantized_logits"]).abs().max() > 100 * bound
    assert (_prompt_logits(_runner(DATA / "bnb-int8", resident=False), ids) - ref["dequantized_logits"]).abs().max() <= (
        RELATIVE * ref["dequantized_logits"].abs().max())  # dequantized when asked: bitsandbytes' own weights
    for m in layers:
        m.threshold = 0.0
    assert (_prompt_logits(runner, ids) - ref["logits"]).abs().max() > 100 * bound


@pytest.mark.parametrize("change, words", [
    ({"llm_int8_has_fp16_weight": True}, ["llm_int8_has_fp16_weight"]),
    ({"llm_int8_threshold": -1}, ["llm_int8_threshold", "-1"]),
    ({"load_in_8bit": False, "_load_in_8bit": False}, ["load_in_4bit", "load_in_8bit"]),
])
def test_a_bad_bitsandbytes_8_bit_config_is_named(change: dict, words: list[str], tmp_path: Path) -> None:
    import json
    import shutil

    out = tmp_path / "bnb-8bit"
    shutil.copytree(DATA / "bnb-int8", out)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"].update(change)
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as e:
        ModelConfig.from_hf(out)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_a_tiled_bitsandbytes_8_bit_layout_is_named(tmp_path: Path) -> None:
    import shutil

    from safetensors.torch import save_file

    out = tmp_path / "bnb-8bit-tiled"
    shutil.copytree(DATA / "bnb-int8", out)
    tensors = load_file(str(out / "model.safetensors"))
    tensors["model.layers.1.mlp.down_proj.weight_format"] = torch.tensor(2, dtype=torch.uint8)
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match=r"down_proj.weight_format is 2: bitsandbytes' tiled"):
        _runner(out)


def _dequantized_dir(name: str, tmp: Path) -> Path:
    """The float32 checkpoint a GPTQ / AWQ fixture means, read by quant_formats.py's readers."""
    src = DATA / name
    qc = ModelConfig.from_hf(src).quantization
    assert qc is not None
    deq: dict[str, torch.Tensor] = {}
    with safe_open(str(src / "model.safetensors"), framework="pt") as sf:
        for key in sf.keys():
            if key.endswith(".qweight"):
                p = key.removesuffix(".qweight")
                get = sf.get_tensor
                if qc.method == "gptq":
                    deq[p + ".weight"] = dequantize_gptq(get(key), get(p + ".qzeros"), get(p + ".scales"),
                                                         get(p + ".g_idx"), qc.bits)
                else:
                    deq[p + ".weight"] = dequantize_awq(get(key), get(p + ".qzeros"), get(p + ".scales"),
                                                        qc.group_size)
    out = tmp / name
    save_dequantized(src, deq, out)
    return out


@pytest.mark.parametrize("name", GPTQ_AWQ)
def test_gptq_and_awq_checkpoints_give_the_dequantized_models_logits(name: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    ids = _reference(name)["input_ids"]
    float_dir = _dequantized_dir(name, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32)
    with torch.no_grad():
        want = hf(ids.reshape(1, -1)).logits[0]
    for resident in (False, True):  # dequantized on load, and kept as int4 (the CUDA layout, torch kernels)
        ours = _prompt_logits(_runner(DATA / name, resident), ids.reshape(-1))
        assert (ours - want).abs().max() <= RELATIVE * want.abs().max(), resident


@pytest.mark.parametrize("name", ["w8a8", "w8a8-asym", "w8a8-static-asym"])
def test_w8a8_int8_quantizes_activations_as_the_checkpoint_says(name: str) -> None:
    """The int8 activations are what makes W8A8 the checkpoint's model: its weights alone (run
    W8A16, as batonlm did before) are far outside the bound from transformers' logits; so is the
    asymmetric activations' product without its zero points' correction (the zero times the
    weight rows' sums)."""
    ref = _reference(name)
    ids, want = ref["input_ids"].reshape(-1), ref["logits"]
    weights_only = _prompt_logits(_runner(DATA / name, resident=False), ids)
    assert (weights_only - want).abs().max() > 100 * RELATIVE * want.abs().max()
    runner = _runner(DATA / name)
    assert (_prompt_logits(runner, ids) - want).abs().max() <= RELATIVE * want.abs().max()
    layers = [m for m in runner.model.modules() if isinstance(m, Int8Linear)]
    assert len(layers) == 8 and all((m.weight_sum is None) == (name == "w8a8") for m in layers)
    if name != "w8a8":
        for m in layers:
            m.weight_sum.zero_()
        assert (_prompt_logits(runner, ids) - want).abs().max() > 100 * RELATIVE * want.abs().max()


def test_a_fused_inputs_static_zero_points_hold_every_layers_range(tmp_path: Path) -> None:
    """q/k/v share one quantized input: calibrated on it, their scales and zero points are equal
    (the fixture's: taken as they are); where a checkpoint's differ, the fused layer quantizes
    over the range that holds each layer's, [(-128 - zero) scale, (127 - zero) scale], to half a
    step at each end (the zero point is rounded), and no wider."""
    import shutil

    from safetensors.torch import save_file

    p = "model.layers.0.self_attn."
    fused = _runner(DATA / "w8a8-static-asym").model.get_submodule(p + "qkv_proj")
    tensors = load_file(str(DATA / "w8a8-static-asym" / "model.safetensors"))
    assert torch.equal(fused.input_scale, tensors[p + "q_proj.input_scale"].float())
    assert torch.equal(fused.input_zero_point, tensors[p + "q_proj.input_zero_point"].int())
    out = tmp_path / "differing"
    shutil.copytree(DATA / "w8a8-static-asym", out)
    tensors[p + "k_proj.input_scale"] = tensors[p + "q_proj.input_scale"] * 3
    tensors[p + "k_proj.input_zero_point"] = torch.tensor([40], dtype=torch.int8)
    tensors[p + "v_proj.input_zero_point"] = torch.tensor([-100], dtype=torch.int8)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    layer = _runner(out).model.get_submodule(p + "qkv_proj")

    def ends(scale: torch.Tensor, zero: torch.Tensor) -> tuple[float, float]:
        s, z = scale.double().item(), zero.double().item()
        return (-128 - z) * s, (127 - z) * s

    members = [ends(tensors[f"{p}{x}_proj.input_scale"], tensors[f"{p}{x}_proj.input_zero_point"]) for x in "qkv"]
    lo, hi = min(e[0] for e in members), max(e[1] for e in members)
    s = layer.input_scale.double().item()
    got_lo, got_hi = ends(layer.input_scale, layer.input_zero_point)
    assert got_lo <= lo + s / 2 and got_hi >= hi - s / 2 and abs(s - (hi - lo) / 255) <= 1e-6 * s


@pytest.mark.parametrize("name", ["fp8-block", "fp8-dynamic"])
def test_cpu_fp8_layers_keep_the_references_float_operand(name: str) -> None:
    """On the CPU an FP8 layer keeps its float32 weight operand from load (the codes, by their
    block scales in blocks) instead of converting its FP8 weight at every call: the logits are
    the uncached reference's bit for bit, and the operand is not counted as a weight."""
    from batonlm.kernels.quant import dequantize_fp8_block
    from batonlm.model_runner.weight_size import held_tensors

    ref = _reference(name)
    ids = ref["input_ids"].reshape(-1)
    runner = _runner(DATA / name)
    layers = [m for m in runner.model.modules() if isinstance(m, Fp8Linear)]
    assert len(layers) == 8
    for m in layers:
        want = (dequantize_fp8_block(m.weight_q, m.weight_scale, m.block, torch.float32) if m.block
                else m.weight_q.float())
        assert m.weight_f is not None and torch.equal(m.weight_f, want)
    assert not any(t is m.weight_f for m in layers for t in held_tensors(runner.model))
    cached = _prompt_logits(runner, ids)
    for m in layers:
        m.weight_f = None
    assert torch.equal(cached, _prompt_logits(runner, ids))


def test_the_layers_kernels_cover_stay_quantized() -> None:
    """On the CPU W8A8 stays quantized, FP8 and int8 (its activations are quantized, as the
    checkpoint says); weight-only formats are dequantized on load unless asked (CUDA's default),
    then int4 and packed int8 (W8A16) alike keep their codes, 4 or 8 bits."""
    def kinds(name: str, resident: bool | None = None) -> set[str]:
        model = _runner(DATA / name, resident).model
        return {type(m).__name__ for m in model.modules() if isinstance(m, (Fp8Linear, Int8Linear, PackedIntLinear))}

    assert kinds("fp8-block") == {"Fp8Linear"} and kinds("fp8-dynamic") == {"Fp8Linear"}
    assert all(kinds(n) == {"Int8Linear"} for n in ("w8a8", "w8a8-static", "w8a8-asym", "w8a8-static-asym"))
    assert kinds("w4a16") == set() and kinds("w4a16", resident=True) == {"PackedIntLinear"}
    assert kinds("w8a16") == set() and kinds("w8a16", resident=True) == {"PackedIntLinear"}
    assert {m.bits for m in _runner(DATA / "w8a16", True).model.modules() if isinstance(m, PackedIntLinear)} == {8}
    # GPTQ in activation order: int4 with each row's group (q/k/v and gate/up share one order:
    # GPTQModel ordered them by the same input's Hessian).
    acts = [m for m in _runner(DATA / "gptqmodel-w4g64-asym-descact", True).model.modules() if isinstance(m, PackedIntLinear)]
    assert len(acts) == 8 and all(m.g_idx is not None and m.group_size == 0 for m in acts)


@pytest.mark.parametrize("name", ["fp8-block", "w4a16", "w8a16", "gptqmodel-awq-w4g64", "gptqmodel-w4g64-asym-descact", "w8a8",
                                  "w8a8-static-asym", "bnb-nf4", "bnb-int8", "nvfp4a16", "nvfp4", "mxfp4a16",
                                  "modelopt-nvfp4", "modelopt-w4a16-nvfp4", "modelopt-mixed"])
def test_gpu_memory_sizing_counts_the_quantized_layers_as_held(name: str) -> None:
    """The KV budget is what the weights leave: a checkpoint whose projections stay quantized
    (on CUDA; here with resident=True) is counted at the quantized layers' bytes (packed int4,
    FP8 and their scales), which the loaded model holds exactly; dequantized, at float bytes."""
    from batonlm.model_runner.model_loader import load_model
    from batonlm.model_runner.weight_size import held_tensors, weight_bytes

    cfg = ModelConfig.from_hf(DATA / name)
    for resident in (True, False):
        model = load_model(cfg, torch.bfloat16, "cpu", resident=resident)[0]
        held = sum(t.numel() * t.element_size() for t in held_tensors(model))
        assert weight_bytes(cfg, torch.bfloat16, device="cpu", resident=resident) == held, resident
    quantized = weight_bytes(cfg, torch.bfloat16, device="cuda")  # CUDA keeps them quantized
    assert quantized == weight_bytes(cfg, torch.bfloat16, device="cpu", resident=True)
    assert quantized < weight_bytes(cfg, torch.bfloat16, device="cpu", resident=False)


def test_deepseek_v3_fp8_blocks_as_released(tiny_models, tmp_path: Path) -> None:
    """DeepSeek-V3's released layout: FP8 weights in blocks with `weight_scale_inv`, its latent
    attention's projections, the shared and every routed expert among them (the router float).
    Read weight-only, its logits are bit-equal to the float model of the dequantized weights:
    every tensor found and read into its place (MLA's per-head rows, the experts' fused rows).
    Kept FP8 (W8A8, as on a GPU and for this format's activations everywhere), the projections
    a layer applies stay FP8, the routed experts too (test_quantized_experts.py); kv_b_proj,
    whose per-head halves the absorbed attention reads, is dequantized."""
    from quant_formats import LINEARS, MLA_LINEARS, save_dequantized, write_fp8_block_checkpoint

    from batonlm.model_runner.models.mla import ProjectionWeight

    fp8, plain = tmp_path / "fp8", tmp_path / "float"
    deq = write_fp8_block_checkpoint(tiny_models["deepseek_v3"], fp8, block=(16, 16), linears=LINEARS + MLA_LINEARS)
    assert any(".experts.3." in k for k in deq) and any("kv_b_proj" in k for k in deq)
    save_dequantized(fp8, deq, plain)
    ids = torch.tensor([1, 40, 7, 300, 22, 91, 5, 77, 140, 3])
    with torch.no_grad():
        assert torch.equal(_prompt_logits(_runner(fp8, resident=False), ids), _prompt_logits(_runner(plain), ids))
        model = _runner(fp8).model
    attn = model.model.layers[1].self_attn
    assert isinstance(attn.q_a_proj, Fp8Linear) and isinstance(attn.kv_a_proj_with_mqa, Fp8Linear)
    assert isinstance(attn.kv_b_proj, ProjectionWeight) and attn.kv_b_proj.weight.dtype == torch.float32
    assert isinstance(model.model.layers[1].mlp.experts, Fp8Experts)


def test_phi3_fused_projections_in_fp8_blocks(tiny_models, tmp_path: Path) -> None:
    """Phi-3 stores q/k/v and gate/up fused (`qkv_proj`, `gate_up_proj`), as batonlm holds them:
    an FP8 block checkpoint of it, read weight-only, gives transformers' logits on the float
    checkpoint of its dequantized weights (the bound above); kept FP8, each layer's weight and
    block scales dequantize to that checkpoint's tensor exactly, so its W8A8 rows are the unfused
    math's (an output row depends on its own weight row and the token's activation groups only)."""
    from quant_formats import save_dequantized, write_fp8_block_checkpoint
    from transformers import AutoModelForCausalLM

    fp8, plain = tmp_path / "fp8", tmp_path / "float"
    block = (16, 16)  # tiny Phi-3: q 64, k/v 32 and gate/up 96 rows each, all whole blocks
    deq = write_fp8_block_checkpoint(tiny_models["phi3"], fp8, block=block,
                                     linears=("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    save_dequantized(fp8, deq, plain)
    ids = torch.tensor([1, 40, 7, 300, 22, 91, 5, 77, 140, 3])
    hf = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32)
    with torch.no_grad():
        want = hf(ids.reshape(1, -1)).logits[0]
        ours = _prompt_logits(_runner(fp8, resident=False), ids)
    assert (ours - want).abs().max() <= RELATIVE * want.abs().max()
    layers = [(name.removesuffix(".local"), m) for name, m in _runner(fp8).model.named_modules()
              if isinstance(m, Fp8Linear)]  # a row-parallel layer holds its quantized part as .local
    assert {name.rsplit(".", 1)[-1] for name, _ in layers} == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    for name, m in layers:
        scale = m.weight_scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[: m.n, : m.k]
        assert torch.equal(m.weight_q.float() * scale, deq[name + ".weight"]), name


def test_phi3_fused_projections_in_gptq_int4(tiny_models, tmp_path: Path) -> None:
    """The same for a GPTQ checkpoint (int4, groups of 32, asymmetric): the fused layers' packed
    columns, scales and zeros split into their parts, dequantized on load and kept as int4."""
    from quant_formats import save_dequantized, write_gptq_checkpoint
    from transformers import AutoModelForCausalLM

    gptq, plain = tmp_path / "gptq", tmp_path / "float"
    deq = write_gptq_checkpoint(tiny_models["phi3"], gptq, group_size=32, sym=False,
                                linears=("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    assert any("qkv_proj" in k for k in deq) and any("gate_up_proj" in k for k in deq)
    save_dequantized(gptq, deq, plain)
    ids = torch.tensor([1, 40, 7, 300, 22, 91, 5, 77, 140, 3])
    hf = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32)
    with torch.no_grad():
        want = hf(ids.reshape(1, -1)).logits[0]
        for resident in (False, True):
            ours = _prompt_logits(_runner(gptq, resident), ids)
            assert (ours - want).abs().max() <= RELATIVE * want.abs().max(), resident
    assert any(isinstance(m, PackedIntLinear) for m in _runner(gptq, True).model.modules())


@pytest.mark.parametrize("name", ["w4a16", "w4a16-asym", "w4a16-gptq", "w8a16", "w8a8", "w8a8-static", "bnb-nf4",
                                  "nvfp4a16", "mxfp4a16", "modelopt-w4a16-nvfp4", *GPTQ_AWQ])
def test_the_int_layout_read_from_shapes_is_the_unpacked_ones(name: str) -> None:
    """What decides whether a layer stays int4 (its bits and consecutive groups) is read without
    unpacking its values; it is what the unpacked layer says, activation order included."""
    from batonlm.model_runner.quantization.dequantized import DequantizedCheckpoint
    from batonlm.model_runner.quantization.formats import int_layout, int_weights
    from batonlm.model_runner.weight_loader import checkpoint_files

    quant = ModelConfig.from_hf(DATA / name).quantization
    assert quant is not None
    with DequantizedCheckpoint(checkpoint_files(DATA / name), quant) as ckpt:
        assert ckpt.linears
        for lin in ckpt.linears.values():
            iw = int_weights(ckpt, lin, quant)
            size = iw.group_size
            want = (iw.bits, -1 if iw.scales.shape[0] == 1 else size)
            assert int_layout(ckpt, lin, quant) == (*want, iw.scales.shape[0]), lin.prefix
    assert name != "gptqmodel-w4g64-asym-descact" or want[1] is None  # a real permutation
