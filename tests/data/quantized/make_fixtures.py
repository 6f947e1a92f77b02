"""Regenerate the quantized test fixtures in this folder (README.md says with which venvs).

    python tests/data/quantized/make_fixtures.py source              # fp32-source (the system transformers 5.25.0)
    V/bin/python tests/data/quantized/make_fixtures.py llmcompressor # fp8-dynamic, fp8-block, w4a16, ... (llm-compressor venv)
    V/bin/python tests/data/quantized/make_fixtures.py gptqmodel     # gptqmodel-* (GPTQModel venv)
    V/bin/python tests/data/quantized/make_fixtures.py helper        # gptq-w4g64, awq-w4g64 (tests/quant_formats.py)
    V/bin/python tests/data/quantized/make_fixtures.py modelopt      # modelopt-* (NVIDIA ModelOpt venv)

Each step runs in its own venv (they pin different transformers), so there is no "all". Every
fixture is made from fp32-source: a tiny random Llama (seed 0) whose shapes allow 128x128
blocks and 128/64 groups: hidden 256, intermediate 384, 4 heads / 2 KV heads of 64, 2 layers,
vocabulary 512 (the stories260K tokenizer's), untied lm_head. Weights are drawn with std 0.2
(transformers' init with initializer_range 0.2, as configs/test-models use: std 0.02 leaves greedy
near-ties, 0.2 gives a median top-1/top-2 logit margin of ~0.9) and norm weights from U(0.5, 1.5);
every weight is then rounded to bfloat16, so the float32 source is exactly the bfloat16 model that
the tools quantize (quantized fixtures keep bfloat16 embeddings, norms and lm_head).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent.parent
REPO = TESTS.parent
SOURCE = HERE / "fp32-source"
TOKENIZER_DIR = REPO / "batonlm" / "assets" / "stories260K"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json")
SEED = 0
INIT_STD = 0.2

CONFIG = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=384,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=512,
    initializer_range=INIT_STD,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)

# llm-compressor fixtures: name -> (recipe kind, scheme preset)
LLMC_FIXTURES = {
    "fp8-dynamic": ("rtn", "FP8_DYNAMIC"),
    "fp8-block": ("rtn", "FP8_BLOCK"),
    "w4a16": ("rtn", "W4A16"),
    "w4a16-asym": ("rtn", "W4A16_ASYM"),
    "w8a16": ("rtn", "W8A16"),
    "w8a8": ("rtn", "W8A8"),
    "w8a8-static": ("static", "W8A8 with static per-tensor activations"),
    "w8a8-asym": ("static", "W8A8 with asymmetric dynamic per-token activations"),
    "w8a8-static-asym": ("static", "W8A8 with asymmetric static per-tensor activations"),
    "w4a16-gptq": ("gptq", "W4A16"),
    "nvfp4a16": ("rtn", "NVFP4A16"),
    "mxfp4a16": ("rtn", "MXFP4A16"),
    "mxfp8": ("rtn", "MXFP8"),  # FP8 weights with an E8M0 exponent per 32 inputs; inputs MXFP8 too (dynamic)
    "mxfp8a16": ("rtn", "MXFP8A16"),  # the same weights only
    "nvfp4": ("calibrated", "NVFP4"),  # FP4 activations too: their global scales calibrated
    # two config groups: attention FP8_DYNAMIC ("re:.*self_attn.*"), every other Linear FP8
    # weight-only per channel ("Linear": the regex outranks the class name where both match)
    "fp8-mixed-wo": ("mixed", "FP8_DYNAMIC attention, FP8 weight-only elsewhere"),
    "w4afp8": ("rtn", "W4AFP8"),  # int4 weights per group of 128, FP8 dynamic per-token activations
    "w4a8": ("rtn", "W4A8"),  # int4 weights per group of 128, int8 dynamic per-token activations
    "mxfp4": ("rtn", "MXFP4"),  # MXFP4A16's weights; inputs MXFP4 too (dynamic, E8M0 scales per 32)
}


def copy_tokenizer(dst: Path) -> None:
    for name in TOKENIZER_FILES:
        shutil.copy(TOKENIZER_DIR / name, dst / name)
    (dst / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}, indent=2) + "\n")


def make_source() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(**CONFIG)
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    if SOURCE.exists():
        shutil.rmtree(SOURCE)
    model.save_pretrained(SOURCE, safe_serialization=True)
    copy_tokenizer(SOURCE)


def calibration_ids(n: int = 16, length: int = 64) -> torch.Tensor:
    """Random token sequences: GPTQ needs activations, not meaningful text, on a random model."""
    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(3, CONFIG["vocab_size"], (n, length), generator=g)
    ids[:, 0] = 1
    return ids


def calibration_dataset():
    from datasets import Dataset

    ids = calibration_ids()
    return Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})


def make_llmcompressor(names: list[str]) -> None:
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    for name in names:
        kind, scheme = LLMC_FIXTURES[name]
        torch.manual_seed(SEED)
        model = AutoModelForCausalLM.from_pretrained(SOURCE, dtype=torch.bfloat16)
        if kind == "rtn":
            recipe = QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"])
            oneshot(model=model, recipe=recipe)
        elif kind == "calibrated":  # a preset whose static activation parameters need data
            recipe = QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"])
            ds = calibration_dataset()
            oneshot(model=model, recipe=recipe, dataset=ds, num_calibration_samples=len(ds), max_seq_length=64)
        elif kind == "static":  # int8 per-channel weights; int8 activations per tensor (calibrated) or token
            from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

            def int8(strategy: str, dynamic: bool, symmetric: bool = True) -> QuantizationArgs:
                return QuantizationArgs(num_bits=8, type="int", strategy=strategy, symmetric=symmetric, dynamic=dynamic)

            dynamic = "dynamic" in scheme
            acts = int8("token" if dynamic else "tensor", dynamic, symmetric="asymmetric" not in scheme)
            group = QuantizationScheme(targets=["Linear"], weights=int8("channel", False), input_activations=acts)
            recipe = QuantizationModifier(config_groups={"group_0": group}, ignore=["lm_head"])
            ds = calibration_dataset()
            oneshot(model=model, recipe=recipe, dataset=ds, num_calibration_samples=len(ds), max_seq_length=64)
        elif kind == "mixed":
            from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

            def fp8(strategy: str, dynamic: bool) -> QuantizationArgs:
                return QuantizationArgs(num_bits=8, type="float", strategy=strategy, symmetric=True, dynamic=dynamic)

            groups = {"attention": QuantizationScheme(targets=["re:.*self_attn.*"], weights=fp8("channel", False),
                                                      input_activations=fp8("token", True)),
                      "rest": QuantizationScheme(targets=["Linear"], weights=fp8("channel", False))}
            oneshot(model=model, recipe=QuantizationModifier(config_groups=groups, ignore=["lm_head"]))
        else:
            recipe = GPTQModifier(targets="Linear", scheme=scheme, ignore=["lm_head"])
            ds = calibration_dataset()
            oneshot(model=model, recipe=recipe, dataset=ds, num_calibration_samples=len(ds), max_seq_length=64)
        out = HERE / name
        if out.exists():
            shutil.rmtree(out)
        model.save_pretrained(out, save_compressed=True)
        copy_tokenizer(out)
        # llm-compressor writes recipe.yaml beside the weights; it is not needed to load them.
        print(name, "->", out)


# GPTQModel fixtures: name -> QuantizeConfig / AWQConfig arguments
GPTQMODEL_FIXTURES = {
    "gptqmodel-w4g64": ("gptq", dict(bits=4, group_size=64, sym=True, desc_act=False)),
    "gptqmodel-w4g64-asym-descact": ("gptq", dict(bits=4, group_size=64, sym=False, desc_act=True)),
    "gptqmodel-awq-w4g64": ("awq", dict(bits=4, group_size=64, sym=False)),
}


def make_gptqmodel(names: list[str]) -> None:
    import os

    # GPTQModel's CPU thread pool wants 2 workers for its model loader; it sizes itself from half
    # the cores (1 on a 2-core machine) unless told.
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
    # GPTQModel writes per-module logs under ./logs: keep them out of the work tree.
    import tempfile

    os.chdir(tempfile.mkdtemp(prefix="gptqmodel-logs-"))
    from gptqmodel import BACKEND, GPTQModel, QuantizeConfig
    from gptqmodel.quantization.config import AWQConfig

    ids = calibration_ids()
    calib = [{"input_ids": row.tolist(), "attention_mask": [1] * len(row)} for row in ids]
    for name in names:
        kind, kw = GPTQMODEL_FIXTURES[name]
        torch.manual_seed(SEED)
        qc = QuantizeConfig(**kw) if kind == "gptq" else AWQConfig(**kw)
        model = GPTQModel.load(str(SOURCE), qc, device="cpu")
        # AWQ's default packing kernel is CUDA's; its torch kernel packs the same GEMM layout.
        backend = BACKEND.AWQ_TORCH if kind == "awq" else BACKEND.AUTO
        model.quantize(calib, batch_size=4, backend=backend)
        out = HERE / name
        if out.exists():
            shutil.rmtree(out)
        model.save(str(out))
        # Per-module quantization log and a temp path: not part of the checkpoint.
        (out / "quant_log.csv").unlink(missing_ok=True)
        copy_tokenizer(out)
        print(name, "->", out)


# bitsandbytes fixtures: name -> BitsAndBytesConfig arguments (transformers quantizes on load)
BNB_FIXTURES = {
    "bnb-nf4": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True),
    "bnb-fp4": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=False),
    "bnb-int8": dict(load_in_8bit=True),  # LLM.int8: int8 weights, a scale (SCB) per output row
}


def make_bitsandbytes(names: list[str]) -> None:
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    for name in names:
        cfg = BitsAndBytesConfig(bnb_4bit_compute_dtype=torch.float32, **BNB_FIXTURES[name])
        model = AutoModelForCausalLM.from_pretrained(SOURCE, quantization_config=cfg, dtype=torch.float32,
                                                     device_map="cpu")
        out = HERE / name
        if out.exists():
            shutil.rmtree(out)
        model.save_pretrained(out)
        copy_tokenizer(out)
        print(name, "->", out)


# NVIDIA ModelOpt fixtures: name -> its quantize config preset
MODELOPT_FIXTURES = {
    "modelopt-nvfp4": "NVFP4_DEFAULT_CFG",  # NVFP4 weights and FP4 activations (W4A4), calibrated
    "modelopt-w4a16-nvfp4": "W4A16_NVFP4_CFG",  # NVFP4 weights only
    # MIXED_PRECISION (what mtq.auto_quantize exports when it picks per layer): NVFP4's preset with
    # the attention projections in FP8 (per tensor, static activation scales)
    "modelopt-mixed": "NVFP4_DEFAULT_CFG, self_attn in FP8_DEFAULT_CFG's format",
    # a tiny Qwen3-MoE (MOE_CONFIG), its experts NVFP4 W4A4 as nvidia's *-FP4 MoE repositories
    "modelopt-nvfp4-moe": "NVFP4_DEFAULT_CFG",
    "modelopt-fp8-pb-wo": "FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG",  # FP8 weights per 128x128 block, float activations
    "modelopt-w8a16": "INT8_WEIGHT_ONLY_CFG",  # int8 weights per output channel, float activations
    "modelopt-mxfp8": "MXFP8_DEFAULT_CFG",  # MXFP8 weights and inputs (E8M0 exponents per 32, ModelOpt's rounding)
    # int4 per 128 inputs with AWQ's calibrated pre_quant_scale (folded into the norms before q/k/v
    # and gate/up by the export; o_proj and down_proj keep theirs)
    "modelopt-int4-awq": "INT4_AWQ_CFG",
    # MIXED_PRECISION with weight-only FP8 blocks beside NVFP4 (as nvidia's NVFP4 releases keep some
    # layers, e.g. their MTP layers, in FP8_PB_WO): the attention projections FP8 per 128x128 block
    "modelopt-mixed-pb-wo": "NVFP4_DEFAULT_CFG, self_attn in FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG's format",
}
# The MoE fixture's source: layer 0 a dense MLP, layer 1 eight experts of 64 features, top 3.
MOE_CONFIG = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_experts=8,
                  num_experts_per_tok=3, num_hidden_layers=2, mlp_only_layers=[0], num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, initializer_range=INIT_STD, norm_topk_prob=True,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                  architectures=["Qwen3MoeForCausalLM"])  # (ModelOpt's export reads the architecture)


def moe_source():
    """The MoE fixture's float model: Qwen3-MoE of MOE_CONFIG, seed 0, initialised as the Llama
    source (std 0.2, norms U(0.5, 1.5)) and rounded to bfloat16."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(SEED)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**MOE_CONFIG)).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    return model.to(torch.bfloat16)


def modelopt_config(name: str) -> dict:
    import copy

    import modelopt.torch.quantization as mtq

    cfg = copy.deepcopy(getattr(mtq, MODELOPT_FIXTURES[name].split(",")[0]))
    if name == "modelopt-mixed":
        fp8 = {"num_bits": (4, 3), "axis": None}
        cfg["quant_cfg"] = list(cfg["quant_cfg"]) + [{"quantizer_name": "*self_attn*weight_quantizer", "cfg": fp8},
                                                     {"quantizer_name": "*self_attn*input_quantizer", "cfg": fp8}]
    if name == "modelopt-mixed-pb-wo":
        blocks = {"num_bits": (4, 3), "axis": None, "block_sizes": {-1: 128, -2: 128}}
        cfg["quant_cfg"] = list(cfg["quant_cfg"]) + [{"quantizer_name": "*self_attn*weight_quantizer", "cfg": blocks},
                                                     {"quantizer_name": "*self_attn*input_quantizer", "enable": False}]
    return cfg


def make_modelopt(names: list[str]) -> None:
    """`mtq.quantize` with the preset, calibrated on the GPTQ fixture's 16 sequences (ModelOpt
    calibrates on the CPU; its fake-quantized forward needs CUDA, so the script does not run the
    quantized model), then `export_hf_checkpoint`: config.json's quantization_config and
    hf_quant_config.json, as nvidia's *-FP4 repositories have them."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM

    ids = calibration_ids()
    for name in names:
        torch.manual_seed(SEED)
        model = moe_source() if name.endswith("-moe") else AutoModelForCausalLM.from_pretrained(SOURCE, dtype=torch.bfloat16)

        def calibrate(m: torch.nn.Module) -> None:
            with torch.no_grad():
                for row in ids:
                    m(row[None])

        model = mtq.quantize(model, modelopt_config(name), calibrate)
        out = HERE / name
        if out.exists():
            shutil.rmtree(out)
        export_hf_checkpoint(model, export_dir=out)
        copy_tokenizer(out)
        print(name, "->", out)


def make_helper() -> None:
    sys.path.insert(0, str(TESTS))
    from quant_formats import write_awq_checkpoint, write_gptq_checkpoint

    for name, fn, kw in (
        ("gptq-w4g64", write_gptq_checkpoint, dict(bits=4, group_size=64, sym=True, desc_act=False)),
        ("awq-w4g64", write_awq_checkpoint, dict(group_size=64, zero_point=True)),
    ):
        out = HERE / name
        if out.exists():
            shutil.rmtree(out)
        fn(SOURCE, out, **kw)
        print(name, "->", out)


if __name__ == "__main__":
    steps = {"source": make_source, "llmcompressor": make_llmcompressor, "gptqmodel": make_gptqmodel, "helper": make_helper,
             "bitsandbytes": make_bitsandbytes, "modelopt": make_modelopt}
    if len(sys.argv) < 2 or sys.argv[1] not in steps:
        sys.exit(__doc__)
    what, names = sys.argv[1], sys.argv[2:]
    if what == "llmcompressor":
        make_llmcompressor(names or list(LLMC_FIXTURES))
    elif what == "gptqmodel":
        make_gptqmodel(names or list(GPTQMODEL_FIXTURES))
    elif what == "bitsandbytes":
        make_bitsandbytes(names or list(BNB_FIXTURES))
    elif what == "modelopt":
        make_modelopt(names or list(MODELOPT_FIXTURES))
    else:
        steps[what]()
