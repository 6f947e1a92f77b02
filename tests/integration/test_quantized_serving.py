"""Quantized checkpoints served: greedy tokens through the scheduler and the device worker equal
transformers' on the checkpoints the tools wrote (tests/data/quantized/README.md), and at two
tensor-parallel ranks equal one rank's (CPU, gloo, the ranks' divergence check at every launch)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from helpers import SchedulerHarness, random_prompts
from quant_formats import write_fp8_block_checkpoint
from safetensors.torch import load_file

DATA = Path(__file__).resolve().parents[1] / "data" / "quantized"


def _greedy(path: str | Path, prompts: list[list[int]], max_new: list[int], graph_steps: list[int] | None = None,
            **args) -> list[list[int]]:
    """Each prompt's greedy tokens (`graph_steps`: given, the decode batches the compiled step
    ran is appended; an inline device worker's)."""
    h = SchedulerHarness(str(path), **args)
    try:
        for i, (ids, n) in enumerate(zip(prompts, max_new)):
            h.submit(f"r{i}", ids, {"temperature": 0.0, "max_new_tokens": n}, at=i)
        records = h.run(overlap=True)
        h.assert_all_free()
        if graph_steps is not None:
            graph_steps.append(h.sched.device.executor.runner.graph_steps)
        return [records[f"r{i}"].token_ids for i in range(len(prompts))]
    finally:
        h.close()


# W8A8 FP8 in blocks and W8A8 int8 per token, symmetric or with zero points, and per tensor with
# zero points, bitsandbytes 8-bit (LLM.int8) (all kept quantized on the CPU too), int4 asymmetric
# (compressed-tensors, dequantized), GPTQ with activation order (a g_idx permutation,
# dequantized), bitsandbytes NF4 (dequantized), NVFP4 weights (dequantized), ModelOpt's NVFP4 W4A4
# (kept packed: its reference is ModelOpt's own arithmetic, transformers has no ModelOpt loader) and
# its MIXED_PRECISION (FP8 and NVFP4 layers; FP8_PB_WO weight-only blocks, kept packed as 8-bit
# codes, and NVFP4), its MXFP8 (kept packed, inputs quantized per 32 in ModelOpt's arithmetic),
# its int4 AWQ (dequantized, the pre_quant_scale folded into the weights); llm-compressor's W4AFP8 (packed int4,
# each input quantized to FP8 per token and back).
@pytest.mark.parametrize("name", ["fp8-block", "w8a8", "w8a8-asym", "w8a8-static-asym", "w4a16-asym", "bnb-nf4",
                                  "bnb-int8", "nvfp4a16", "modelopt-nvfp4", "modelopt-mixed", "modelopt-mixed-pb-wo", "modelopt-mxfp8",
                                  "modelopt-int4-awq", "w4afp8",
                                  "gptqmodel-w4g64-asym-descact"])
def test_served_greedy_tokens_are_transformers(name: str) -> None:
    ref = load_file(str(DATA / name / "reference.safetensors"))
    want = ref["greedy_ids"].tolist()  # 16 tokens, or fewer ending in the EOS (2)
    assert _greedy(DATA / name, [ref["input_ids"].reshape(-1).tolist()], [16]) == [want]


def test_two_ranks_give_one_ranks_tokens(tmp_path: Path) -> None:
    """GPTQ int4 (group 64: each rank's down_proj columns are whole groups), W8A8 FP8 in 64x64
    blocks (each rank's rows and columns are whole blocks: its activation groups are one rank's)
    and W8A8 int8 with static activation scales (every rank's the same; int8 W8A8 per token is
    not: a row-parallel rank quantizes its own slice of a token, test_quantized_sharding.py)."""
    fp8 = tmp_path / "fp8-block64"
    write_fp8_block_checkpoint(DATA / "fp32-source", fp8, block=(64, 64))
    prompts = random_prompts(4, random.Random(3), lo=2, hi=60)
    max_new = [24, 12, 30, 18]
    for path in (DATA / "gptqmodel-w4g64", fp8, DATA / "w8a8-static"):
        one = _greedy(path, prompts, max_new)
        assert _greedy(path, prompts, max_new, tp_size=2, debug_tp_check_every=1) == one, path.name


def test_static_quantized_experts_serve(tiny_models, tmp_path: Path) -> None:
    """MoE checkpoints with static activation scales (AutoFP8 FP8 Mixtral, W8A8 int8 static
    Qwen3-MoE), experts kept quantized, and the float Qwen3-MoE: the compiled step (its batch-1
    graph gathering the routed experts, its 2-64 row graph running the quantized ones densely
    and calling the float ones' grouped op) runs the decode batches and gives the eager step's
    greedy tokens; two ranks give one rank's (every rank quantizes by the same scales)."""
    from quant_formats import LINEARS
    from quant_w8a8 import write_static_checkpoint

    prompts = random_prompts(3, random.Random(5), lo=2, hi=40)
    max_new = [20, 9, 14]
    for family, kind, experts in (("mixtral", "autofp8", ("w1", "w3", "w2")),
                                  ("qwen3_moe", "int8", ("gate_proj", "up_proj", "down_proj")),
                                  ("qwen3_moe", None, ())):
        path = Path(tiny_models[family])
        if kind is not None:
            path = tmp_path / f"{family}-{kind}"
            write_static_checkpoint(tiny_models[family], path, kind, LINEARS + experts)
        eager = _greedy(path, prompts, max_new)
        steps: list[int] = []
        compiled = _greedy(path, prompts, max_new, compile="on", compile_cache_dir=str(tmp_path / "inductor"),
                           cpu_device_worker="inline", graph_steps=steps)
        # A decode step that fails to compile runs eagerly (one warning): no batch through a graph.
        assert steps[0] >= max(max_new) - len(max_new), (path.name, steps)
        assert compiled == eager, path.name
        if kind == "int8":
            assert _greedy(path, prompts, max_new, tp_size=2, debug_tp_check_every=1) == eager, path.name
