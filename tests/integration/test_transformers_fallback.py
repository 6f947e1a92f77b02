"""The transformers fallback: architectures batonlm has no module for run on transformers' own
modeling code with batonlm's paged KV cache, token-identical to transformers' `generate`, in
both loops with the prefix cache and chunked prefill; what it cannot do is refused in one line."""

from __future__ import annotations

import json
import random
import shutil
import zlib

import httpx
import pytest
import torch
from helpers import (
    FALLBACK_FAMILIES,
    SchedulerHarness,
    build_tiny_model,
    copy_tokenizer,
    hf_greedy,
    random_prompts,
)

from batonlm.bench.server_process import ServerProcess
from batonlm.device.spec import DeviceConfigError
from batonlm.model_runner.model_config import ModelConfig, ModelConfigError


@pytest.fixture(scope="module")
def fallback_models(tmp_path_factory) -> dict[str, str]:
    """Tiny random models of configs/test-models/transformers/*.json: GPT-NeoX (partial rotary,
    parallel residual, LayerNorm, biases), OLMo-2 (norms after attention and MLP, q/k norms over
    all heads), Granite (embedding/residual/attention multipliers, logits scaling, tied). Gemma 2
    on transformers' code: `test_a_native_architecture_on_transformers_gives_the_native_tokens`."""
    root = tmp_path_factory.mktemp("fallback_models")
    out = {}
    for family in FALLBACK_FAMILIES:
        build_tiny_model(family, root / family)
        copy_tokenizer(root / family)
        out[family] = str(root / family)
    return out


def _workload(family: str):
    rng = random.Random(zlib.crc32(family.encode()))
    prompts = random_prompts(6, rng, lo=1, hi=120)
    prompts.append(prompts[1][:40] + prompts[2][:10])  # a cached prefix of prompt 1 (16-token blocks)
    return prompts, [rng.randint(8, 20) for _ in prompts]


def _both_loops_give(path, prompts, max_new, want) -> int:
    """Both loops (chunked prefill of 16, the second pass on the first's cached prompts) give
    `want`; returns the tokens the prefix cache held after them."""
    h = SchedulerHarness(str(path), chunked_prefill_size=16)
    try:
        for overlap in (False, True):
            assert _run(h, prompts, max_new, overlap) == want, f"overlap={overlap}"
        return h.sched.memory.cached_tokens
    finally:
        h.close()


def _run(h: SchedulerHarness, prompts, max_new, overlap: bool) -> list[list[int]]:
    for i, (ids, n) in enumerate(zip(prompts, max_new)):
        h.submit(f"r{i}", ids, {"temperature": 0.0, "max_new_tokens": n}, at=2 * i)
    records = h.run(overlap=overlap)
    h.assert_all_free()
    return [records[f"r{i}"].token_ids for i in range(len(prompts))]


@pytest.mark.parametrize("family", FALLBACK_FAMILIES)
def test_fallback_matches_transformers_generate(fallback_models, family):
    path = fallback_models[family]
    assert ModelConfig.from_hf(path).impl == "transformers"  # auto: batonlm has no module for it
    prompts, max_new = _workload(family)
    cached = _both_loops_give(path, prompts, max_new, hf_greedy(path, prompts, max_new))
    assert cached > 0, "the second pass found no prompt cached"


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_a_native_architecture_on_transformers_gives_the_native_tokens(tiny_models, family):
    """`--model-impl transformers` on a Llama, and on Gemma 2 (a sliding layer then a global one,
    query_pre_attn_scalar, attention soft-capping small enough to change every output, passed per
    layer by transformers' code): transformers' code through batonlm's cache gives what
    batonlm's own model gives (and transformers' generate)."""
    path = tiny_models[family]
    assert ModelConfig.from_hf(path, "transformers").impl == "transformers"
    prompts, max_new = _workload(family)
    out = {}
    for impl in ("native", "transformers"):
        h = SchedulerHarness(path, model_impl=impl, chunked_prefill_size=16)
        try:
            out[impl] = _run(h, prompts, max_new, overlap=True)
        finally:
            h.close()
    assert out["transformers"] == out["native"] == hf_greedy(path, prompts, max_new)


def test_what_the_fallback_cannot_do_is_refused_in_one_line(fallback_models, tmp_path):
    path = fallback_models["gpt_neox"]
    with pytest.raises(ModelConfigError, match="'GPTNeoXForCausalLM' has no native module .*--model-impl auto"):
        ModelConfig.from_hf(path, "native")
    with pytest.raises(DeviceConfigError, match="transformers' modeling code, on one device per replica: --tp"):
        SchedulerHarness(path, tp_size=2)
    with pytest.raises(DeviceConfigError, match="--compile on"):
        SchedulerHarness(path, compile="on")
    # Neither batonlm nor transformers: one line naming it and what is supported.
    import json
    import shutil

    for arch, why in (("FalconForCausalLM", "takes no pluggable attention function"),
                      ("NotAModelForCausalLM", "has no causal LM class 'NotAModelForCausalLM'")):
        d = tmp_path / arch
        shutil.copytree(path, d)
        raw = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**raw, "architectures": [arch]}))
        with pytest.raises(ModelConfigError) as e:
            ModelConfig.from_hf(d)
        msg = str(e.value)
        assert f"model architecture {arch!r} is not supported" in msg and why in msg
        assert "native: LlamaForCausalLM" in msg and "\n" not in msg


def test_a_weight_only_quantized_checkpoint_runs_dequantized(fallback_models, tmp_path):
    """GPTQ int4 of GPT-NeoX (no native module) on transformers' code, its weights dequantized:
    transformers' greedy tokens on the float checkpoint it means, in both loops. A checkpoint
    that quantizes activations too (W8A8) is refused in one line naming what runs."""
    from quant_formats import save_dequantized, write_gptq_checkpoint
    from quant_w8a8 import write_w8a8_checkpoint

    src = fallback_models["gpt_neox"]
    linears = ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h")
    gptq = tmp_path / "gptq"
    deq = write_gptq_checkpoint(src, gptq, bits=4, group_size=32, sym=False, linears=linears)
    save_dequantized(gptq, deq, tmp_path / "float")
    cfg = ModelConfig.from_hf(gptq)
    assert cfg.impl == "transformers" and cfg.quantization is not None
    from batonlm.model_runner.weight_size import weight_bytes

    # A GPU's KV budget counts the dequantized weights: the float model's bytes.
    assert weight_bytes(cfg, torch.bfloat16, device="cpu") == weight_bytes(ModelConfig.from_hf(src), torch.bfloat16,
                                                                          device="cpu")
    prompts, max_new = _workload("gpt_neox")
    want = hf_greedy(str(tmp_path / "float"), prompts, max_new)
    assert want != hf_greedy(src, prompts, max_new)  # the rounding shows: the float source is not the reference
    _both_loops_give(gptq, prompts, max_new, want)
    write_w8a8_checkpoint(src, tmp_path / "w8a8", linears=linears)
    with pytest.raises(ModelConfigError, match=r"activations are quantized too .*GPTNeoXForCausalLM has none.*GPTQ"):
        ModelConfig.from_hf(tmp_path / "w8a8")


def test_gpt_oss_mxfp4_experts_run_as_transformers_reads_them(fallback_models, tiny_models, tmp_path):
    """gpt-oss with its MoE experts in MXFP4 (OpenAI's release layout, `quant_method: mxfp4`:
    tests/quant_gpt_oss.py), on transformers' code with the experts dequantized: the greedy tokens
    of transformers loading the same checkpoint (`Mxfp4Config(dequantize=True)`, its own
    dequantization), in both loops, with the prefix cache and chunked prefill; the GPU's KV
    budget counts the float experts; a native architecture declaring mxfp4 is refused in one line."""
    from quant_gpt_oss import write_gpt_oss_mxfp4_checkpoint
    from transformers import Mxfp4Config

    from batonlm.model_runner.weight_size import weight_bytes

    src = fallback_models["gpt_oss"]
    path = tmp_path / "gpt-oss-mxfp4"
    write_gpt_oss_mxfp4_checkpoint(src, path)
    cfg = ModelConfig.from_hf(path)
    assert cfg.impl == "transformers" and cfg.quantization is not None and cfg.quantization.method == "mxfp4"
    assert weight_bytes(cfg, torch.bfloat16, device="cpu") == weight_bytes(ModelConfig.from_hf(src), torch.bfloat16,
                                                                          device="cpu")
    prompts, max_new = _workload("gpt_oss")
    want = hf_greedy(str(path), prompts, max_new, quantization_config=Mxfp4Config(dequantize=True))
    assert want != hf_greedy(src, prompts, max_new)  # FP4's rounding shows: the float source is not the reference
    _both_loops_give(path, prompts, max_new, want)
    llama = tmp_path / "llama-mxfp4"
    shutil.copytree(tiny_models["llama"], llama)
    raw = json.loads((llama / "config.json").read_text())
    (llama / "config.json").write_text(json.dumps({**raw, "quantization_config": {"quant_method": "mxfp4"}}))
    with pytest.raises(ModelConfigError, match="mxfp4 checkpoints .gpt-oss's MoE experts. run on transformers'"):
        ModelConfig.from_hf(llama)


def test_serve_says_which_code_runs_the_model(fallback_models):
    """As a user starts it: the ready line names transformers' modeling code, and a greedy
    answer is transformers' continuation."""
    path = fallback_models["olmo2"]
    s = ServerProcess(path, "--max-running-requests", "4")
    try:
        r = httpx.post(s.base_url + "/generate", json={
            "input_ids": [1, 40, 41, 42], "sampling_params": {"max_new_tokens": 6, "temperature": 0},
        }, timeout=60)
        assert r.status_code == 200, r.text
        log = s.log()
    finally:
        assert s.stop() == 0
    assert "(model olmo2 on transformers' modeling code, cpu" in log
    assert "the decode step runs eagerly" in log
    assert r.json()["output_ids"] == hf_greedy(path, [[1, 40, 41, 42]], [6])[0]
