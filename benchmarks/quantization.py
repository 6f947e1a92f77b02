"""Quantized weights: what each layout costs per matmul, and end to end.

Part 1, one projection (K -> N) at M rows, median of `--rounds` (the ways alternating in each
round): the float matmul (what a checkpoint dequantized on load runs: batonlm's CPU choice for
weight-only formats), the int4 dequant-GEMM (and with bitsandbytes' NF4 codebook, blocks of
64; NVFP4's, float8 scales per 16 and a per-tensor scale, also after its FP4 activation
quantization; weight-only FP8 as 8-bit codes through the e4m3 table, and MXFP8 with its E8M0
exponents after its input quantization), the W8A8 FP8 GEMM (`batonlm/kernels/quant.py`, in blocks
and per channel with FBGEMM's capped per-token inputs; the torch references on the CPU, which
dequantize every call; Triton on CUDA), the W8A8 int8 GEMM with its per-token activation
quantization (`batonlm/kernels/int8.py`: on the CPU oneDNN's int8 GEMM through `torch._int_mm`;
Triton on CUDA) and bitsandbytes' LLM.int8 (`batonlm/kernels/llm_int8.py`: int8 rows, outlier
columns in float). The CPU's choice for weight-only formats is this table: a dequantize per call
costs more than the float matmul it feeds.

Part 2, a random model (`--shape`: Llamas, or `qwen3-moe`, a small Qwen3-MoE whose experts stay
quantized where its projections do) written as float, W8A8 FP8 in 128x128 blocks (transformers'
FineGrainedFP8 format), W8A8 int8 (llm-compressor's format, tests/quant_w8a8.py), GPTQ int4
(group 128), bitsandbytes NF4 (blocks of 64) and 8-bit LLM.int8 (tests/quant_bnb.py), NVFP4A16
and ModelOpt's NVFP4 W4A4 (tests/quant_nvfp4.py), FBGEMM FP8 (tests/quant_fbgemm.py), ModelOpt's
weight-only FP8 blocks and llm-compressor's MXFP8 (tests/quant_mxfp8.py), served by
`batonlm.Engine` (overlap loop; eager step unless `--compile on`), plus `--quantization fp8` on
the float checkpoint, and AutoFP8's static FP8 (per-tensor weights and input scales,
tests/quant_w8a8.py: Mixtral-8x7B-FP8's format): start-up seconds, checkpoint MB, and output
tok/s of B streams of `--new-tokens` greedy tokens (EOS ignored, prefill included), median of
`--rounds`. On CUDA the quantized variants run on the kernels (the weights stay quantized); on
the CPU int4, NF4, NVFP4A16 and online FP8 run dequantized, W8A8, LLM.int8 and NVFP4 W4A4 on the
torch references.

    python benchmarks/quantization.py [--batch 1 16 64] [--compile on] [--json out.json]
    python benchmarks/quantization.py --device cuda --dtype bfloat16 [--shape llama3-8b --layers 8]
    python benchmarks/quantization.py --shape qwen3-moe [--device cuda --dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))  # the checkpoint writers the tests check against the tools
from models import stream_tok_s, table  # noqa: E402
from quant_bnb import NF4, write_bnb4_checkpoint, write_int8_checkpoint  # noqa: E402
from quant_fbgemm import write_fbgemm_fp8_checkpoint  # noqa: E402
from quant_formats import write_fp8_block_checkpoint, write_gptq_checkpoint  # noqa: E402
from quant_mxfp8 import write_modelopt_fp8_pb_wo_checkpoint, write_mxfp8_checkpoint  # noqa: E402
from quant_nvfp4 import E2M1, write_modelopt_nvfp4_checkpoint, write_nvfp4_checkpoint  # noqa: E402
from quant_w8a8 import write_static_checkpoint, write_w8a8_checkpoint  # noqa: E402
from vs_transformers import build_random_llama  # noqa: E402

from batonlm.kernels.fp4 import modelopt_nvfp4_fake_quant  # noqa: E402
from batonlm.kernels.int4 import int4_dequant_matmul, pack_int4  # noqa: E402
from batonlm.kernels.int8 import (  # noqa: E402
    int8_scaled_matmul,
    per_token_quant_int8,
    per_token_quant_int8_asym,
    weight_sums,
)
from batonlm.kernels.llm_int8 import llm_int8_matmul, llm_int8_quant  # noqa: E402
from batonlm.kernels.mxfp8 import ct_mxfp8_fake_quant  # noqa: E402
from batonlm.kernels.quant import (  # noqa: E402
    FBGEMM_MIN_SCALE,
    fp8_block_matmul,
    fp8_scaled_matmul,
    per_token_group_quant_fp8,
    per_token_quant_fp8,
)
from batonlm.model_runner.quantization.fp8_weight_only import codebook as fp8_codebook  # noqa: E402

SHAPES = {
    "32m": {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 8,
            "num_key_value_heads": 4, "head_dim": 64, "vocab_size": 8192},
    "llama3-8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256},
    # A small Qwen3-MoE: 32 experts, top 4, whose experts are most of its bytes (the FP8, int8 and
    # int4 variants keep them quantized where the projections are: docs/quantization.md).
    "qwen3-moe": {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 512,
                  "intermediate_size": 1536, "moe_intermediate_size": 256, "num_experts": 32,
                  "num_experts_per_tok": 4, "num_hidden_layers": 4, "num_attention_heads": 8,
                  "num_key_value_heads": 4, "head_dim": 64, "vocab_size": 8192, "norm_topk_prob": True},
}


def layer_costs(ms: list[int], k: int, n: int, rounds: int, device: str, dtype: torch.dtype) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(device, dtype)
    q = torch.randint(0, 16, (k, n), generator=g, dtype=torch.int32)
    qweight, scales = pack_int4(q).to(device), (torch.rand(k // 128, n, generator=g) / 64).to(device)
    zeros = torch.full((k // 128, n), 8, dtype=torch.uint8, device=device)
    nf4, absmax = torch.tensor(NF4, device=device), (torch.rand(k // 64, n, generator=g) / 64).to(device)
    e2m1 = torch.cat([E2M1, -E2M1]).to(device)  # NVFP4: float8 scales per 16 inputs, a per-tensor scale
    fp4_scales = (torch.rand(k // 16, n, generator=g) * 400 + 40).to(torch.float8_e4m3fn).to(device)
    fp4_scale_2 = torch.full((n,), 1e-4, device=device)
    input_scale = torch.tensor([1 / 600], device=device)
    w_q = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn).to(device)
    w_scale = torch.rand(-(-n // 128), k // 128, generator=g).to(device) / 100
    w_i8 = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8).to(device)
    w_i8_scale = (torch.rand(n, generator=g) / 100).to(device)
    w_i8_sum = weight_sums(w_i8)
    # FP8 as 8-bit codes through the e4m3 table (weight-only FP8 blocks; MXFP8 with E8M0 exponents)
    e4m3 = fp8_codebook("F8_E4M3").to(device)
    q8 = torch.randint(0, 126, (k, n), generator=g, dtype=torch.int32)  # (finite codes)
    qweight8 = pack_int4(q8, 8).to(device)
    block_scales = (torch.rand(k // 128, n, generator=g) / 100).to(device)
    exponents = torch.randint(110, 120, (k // 32, n), generator=g, dtype=torch.uint8).to(device)
    w_channel = (torch.rand(n, generator=g) / 100).to(device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    rows = []
    for m in ms:
        x = torch.randn(m, k, generator=g).to(device, dtype)

        def fp8(x=x):
            x_q, x_s = per_token_group_quant_fp8(x, 128)
            return fp8_block_matmul(x_q, x_s, w_q, w_scale, (128, 128), x.dtype)

        def int8(x=x):
            x_q, x_s = per_token_quant_int8(x)
            return int8_scaled_matmul(x_q, x_s, w_i8, w_i8_scale, x.dtype)

        def int8_asym(x=x):  # asymmetric activations: a zero point per token, taken off by the row sums
            x_q, x_s, x_z = per_token_quant_int8_asym(x)
            return int8_scaled_matmul(x_q, x_s, w_i8, w_i8_scale, x.dtype, x_zero=x_z, w_sum=w_i8_sum)

        def llm_int8(x=x):  # bitsandbytes 8-bit: int8 rows with outlier columns (here none: |x| < 6 mostly)
            return llm_int8_matmul(x, *llm_int8_quant(x, 6.0), w_i8, w_i8_scale)

        def nvfp4(x=x):
            return int4_dequant_matmul(x, qweight, fp4_scales, None, 16, codebook=e2m1, scale_2=fp4_scale_2)

        def nvfp4_w4a4(x=x):  # the FP4 activations first (ModelOpt's arithmetic)
            return nvfp4(modelopt_nvfp4_fake_quant(x, input_scale))

        def fp8_weight_only(x=x):  # ModelOpt's FP8_PB_WO: float inputs, FP8 codes per 128x128 block
            return int4_dequant_matmul(x, qweight8, block_scales, None, 128, bits=8, codebook=e4m3)

        def mxfp8(x=x):  # the MXFP8 inputs first, then the codes with their E8M0 exponents
            return int4_dequant_matmul(ct_mxfp8_fake_quant(x), qweight8, exponents, None, 32, bits=8, codebook=e4m3)

        def fbgemm(x=x):  # per-token FP8 inputs, their amax capped (FBGEMM's), per-channel weights
            x_q, x_s = per_token_quant_fp8(x, amax_ub=1200.0, min_scale=FBGEMM_MIN_SCALE)
            return fp8_scaled_matmul(x_q, x_s, w_q, w_channel, x.dtype)

        ways = {"float": lambda x=x: F.linear(x, w), "int4 dequant-GEMM": lambda x=x: int4_dequant_matmul(
            x, qweight, scales, zeros, 128), "nf4 codebook GEMM": lambda x=x: int4_dequant_matmul(
            x, qweight, absmax, None, 64, codebook=nf4), "nvfp4 GEMM": nvfp4, "nvfp4 W4A4": nvfp4_w4a4,
            "fp8 W8A8 block": fp8, "fp8 W8A8 channel (fbgemm)": fbgemm, "fp8 weight-only GEMM": fp8_weight_only,
            "mxfp8 W8A8": mxfp8, "int8 W8A8": int8, "int8 W8A8 asym": int8_asym, "LLM.int8": llm_int8}
        times: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(rounds):
            for name, fn in ways.items():
                fn()
                sync()
                t0 = time.perf_counter()
                for _ in range(10):
                    fn()
                sync()
                times[name].append((time.perf_counter() - t0) / 10)
        base = statistics.median(times["float"])
        row: dict = {"M": m, "K x N": f"{k}x{n}"}
        for name in ways:
            t = statistics.median(times[name])
            row[f"{name} us"] = round(t * 1e6, 1)
            row[f"{name} / float"] = round(t / base, 2)
        rows.append(row)
    return rows


def variants(src: str, out: Path, only: list[str] | None = None) -> dict[str, tuple[str, dict]]:
    """name -> (model directory, Engine arguments), each checkpoint written only when `only` keeps it
    (a big shape's writes are most of its run)."""
    writers = {  # name -> (directory, its writer or None for the float checkpoint, Engine arguments)
        "float": (src, None, {}),
        "fp8 W8A8 block": (out / "fp8-block", write_fp8_block_checkpoint, {}),
        "int8 W8A8": (out / "w8a8-int8", write_w8a8_checkpoint, {}),
        "int8 W8A8 asym": (out / "w8a8-int8-asym", lambda s, d: write_w8a8_checkpoint(s, d, asym_activations=True), {}),
        "fp8 static (AutoFP8)": (out / "fp8-static", lambda s, d: write_static_checkpoint(s, d, "autofp8"), {}),
        "gptq int4 g128": (out / "gptq-int4", lambda s, d: write_gptq_checkpoint(s, d, bits=4, group_size=128, sym=True), {}),
        "bnb nf4 (bitsandbytes)": (out / "bnb-nf4", write_bnb4_checkpoint, {}),
        "bnb int8 (LLM.int8)": (out / "bnb-int8", write_int8_checkpoint, {}),
        "nvfp4 (NVFP4A16)": (out / "nvfp4a16", write_nvfp4_checkpoint, {}),
        "nvfp4 W4A4 (ModelOpt)": (out / "modelopt-nvfp4",
                                  lambda s, d: write_modelopt_nvfp4_checkpoint(s, d, input_scale=1 / 600), {}),
        "fp8 W8A8 channel (fbgemm_fp8)": (out / "fbgemm-fp8", write_fbgemm_fp8_checkpoint, {}),
        "fp8 weight-only blocks (ModelOpt FP8_PB_WO)": (out / "fp8-pb-wo", write_modelopt_fp8_pb_wo_checkpoint, {}),
        "mxfp8 W8A8 (llm-compressor MXFP8)": (out / "mxfp8", write_mxfp8_checkpoint, {}),
        "fp8 online (per channel)": (src, None, {"quantization": "fp8"}),
    }
    chosen = {}
    for name, (path, write, extra) in writers.items():
        if only and not any(o in name for o in only):
            continue
        if write is not None:
            write(src, path)
        chosen[name] = (str(path), extra)
    return chosen


def served(models: dict[str, tuple[str, dict]], batches: list[int], new_tokens: int, rounds: int, device: str,
           dtype: str, compile: str = "off") -> list[dict]:
    from batonlm import Engine

    rows = []
    for name, (path, extra) in models.items():
        t0 = time.perf_counter()
        engine = Engine(path, compile=compile, max_running_requests=max(batches), device=device, dtype=dtype, **extra)
        start = time.perf_counter() - t0
        size = sum(f.stat().st_size for f in Path(path).glob("*.safetensors")) / 2**20
        try:
            row: dict = {"weights": name, "start s": round(start, 1), "checkpoint MB": round(size, 1)}
            for b in batches:
                row[f"{b} streams tok/s"] = stream_tok_s(engine, b, new_tokens, rounds)
            rows.append(row)
        finally:
            engine.shutdown()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="32m")
    ap.add_argument("--layers", type=int, help="override the shape's layer count (a big shape in less memory)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--compile", choices=["on", "off", "auto"], default="off",
                    help="Part 2's step: eager (the kernels' path, the default here), the compiled CPU "
                         "decode step, or what `batonlm serve` runs by default (auto: a MoE model's "
                         "batch-1 graph only)")
    ap.add_argument("--only", nargs="+", metavar="NAME",
                    help="serve only the variants whose names contain one of these (e.g. int8 float)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    shape = dict(SHAPES[args.shape], **({"num_hidden_layers": args.layers} if args.layers else {}))
    dtype = getattr(torch, args.dtype)
    h, i = shape["hidden_size"], shape.get("moe_intermediate_size", shape["intermediate_size"])
    where = f"{torch.get_num_threads()} threads" if args.device == "cpu" else args.device
    print(f"Part 1: one projection, {args.dtype}, {where}")
    layers = layer_costs(args.batch, h, i, args.rounds, args.device, dtype)
    layers += layer_costs(args.batch, i, h, args.rounds, args.device, dtype)
    print(table(layers))
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "config.json"
        config.write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                      "tie_word_embeddings": False, **shape}))  # a shape may name its family
        src = build_random_llama(config, Path(tmp) / "float")
        print(f"\nPart 2: a random model ({args.shape}, {shape['num_hidden_layers']} layers) served, "
              f"{args.new_tokens} new tokens per stream, { {'on': 'compiled', 'off': 'eager', 'auto': 'default (--compile auto)'}[args.compile]} step")
        models = variants(src, Path(tmp), args.only)
        rows = served(models, args.batch, args.new_tokens, args.rounds, args.device, args.dtype, args.compile)
    print(table(rows))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"shape": shape, "device": where, "dtype": args.dtype, "layers": layers,
                                         "compile": args.compile, "served": rows}, indent=2))


if __name__ == "__main__":
    main()
