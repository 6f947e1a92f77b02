"""Time the Triton sampling kernels against their torch references on a CUDA GPU.

For batch 1, 16, 64, 256 x vocabulary 32000, 151936: sampling (Triton; the sort-based torch
reference; the usual torch sampler: sort, top-k/top-p masks, torch.multinomial), greedy argmax,
penalties and logprobs (top 5). For M = 1, 16, 64, 256 rows of a 4096 x 4096 linear layer: the
quantized kernels (FP8 activation quantization, FP8 block-wise and per-channel GEMMs, int4
weight-only, group 128, int8 per-token quantization and the W8A8 int8 GEMM) against their torch
references and the unquantized bfloat16 matmul. Times are CUDA-event means after warm-up. Prints a table and
writes benchmarks/results/kernels_gpu.json. Without CUDA it prints "skipped: no CUDA device"
and exits 0.

    python benchmarks/kernels_gpu.py [--iters 50] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path

# Compiled kernels: the interpreter would time numpy.
os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402

BATCHES = (1, 16, 64, 256)
VOCABS = (32000, 151936)
TEMPERATURE, TOP_K, TOP_P, MIN_P = 0.8, 50, 0.9, 0.05
TOP_N = 5
QUANT_N, QUANT_K, QUANT_GROUP = 4096, 4096, 128
DEFAULT_OUT = Path(__file__).parent / "results" / "local" / "kernels_gpu.json"


def cuda_ms(fn: Callable[[], object], iters: int, warmup: int = 3) -> float:
    """Mean milliseconds of fn() on the current stream, by CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def multinomial_sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The common torch sampler: sort once, mask past top-k and past top-p, torch.multinomial."""
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    sorted_p, sorted_ids = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    sorted_p = sorted_p.masked_fill(ranks >= top_k[:, None], 0.0)
    before = sorted_p.cumsum(-1) - sorted_p  # mass ahead of each token
    sorted_p = sorted_p.masked_fill(before >= top_p[:, None] * sorted_p.sum(-1, keepdim=True), 0.0)
    choice = torch.multinomial(sorted_p, 1)
    return sorted_ids.gather(1, choice)[:, 0]


def bench_shape(b: int, v: int, iters: int, dev: str = "cuda") -> list[dict]:
    from batonlm.kernels import sampling as s
    from batonlm.kernels.logprobs import logprobs_reference, logprobs_triton
    from batonlm.kernels.penalties import PenaltyBatch, apply_penalties_reference, apply_penalties_triton

    g = torch.Generator(device=dev).manual_seed(b * 7 + v)
    logits = torch.randn(b, v, device=dev, generator=g) * 3
    temp = torch.full((b,), TEMPERATURE, device=dev)
    top_k = torch.full((b,), TOP_K, device=dev, dtype=torch.int64)
    top_p = torch.full((b,), TOP_P, device=dev)
    min_p = torch.full((b,), MIN_P, device=dev)
    keys = s.row_keys(torch.arange(b, device=dev), torch.zeros(b, dtype=torch.int64, device=dev), torch.full((b,), 3, device=dev))
    draw = s.DrawBatch(temp, top_k, top_p, min_p, keys)
    counts = torch.randint(0, 3, (b, v), device=dev, generator=g, dtype=torch.int32)
    counts *= (torch.rand(b, v, device=dev, generator=g) < 0.002).int()
    pen = (
        logits,
        PenaltyBatch(
            torch.arange(b, device=dev), counts, torch.rand(b, v, device=dev, generator=g) < 0.002,
            torch.full((b,), 0.3, device=dev), torch.full((b,), 0.2, device=dev), torch.full((b,), 1.1, device=dev),
            torch.randint(0, v, (b, 4), device=dev, generator=g), torch.randn(b, 4, device=dev, generator=g),
        ),
        torch.randint(0, v, (b, 2), device=dev, generator=g),
    )
    chosen = logits.argmax(-1)
    # How often the kernel and the reference draw the same token (near-ties aside: all).
    match = float((s.sample_triton(logits, draw) == s.sample_reference(logits, draw)).float().mean())
    cases = [
        ("sample", "triton", lambda: s.sample_triton(logits, draw)),
        ("sample", "torch reference", lambda: s.sample_reference(logits, draw)),
        ("sample", "torch sort+multinomial", lambda: multinomial_sample(logits, temp, top_k, top_p)),
        ("argmax", "triton", lambda: s.argmax_triton(logits)),
        ("argmax", "torch reference", lambda: s.argmax_reference(logits)),
        ("penalties", "triton", lambda: apply_penalties_triton(*pen)),
        ("penalties", "torch reference", lambda: apply_penalties_reference(*pen)),
        (f"logprobs top-{TOP_N}", "triton", lambda: logprobs_triton(logits, temp, chosen, TOP_N)),
        (f"logprobs top-{TOP_N}", "torch reference", lambda: logprobs_reference(logits, temp, chosen, TOP_N)),
    ]
    rows = []
    for op, impl, fn in cases:
        row = {"op": op, "impl": impl, "batch": b, "vocab": v, "ms": round(cuda_ms(fn, iters), 4)}
        if op == "sample" and impl == "triton":
            row["same_token_as_reference"] = match
        rows.append(row)
    return rows


def bench_quant(m: int, iters: int, n: int = QUANT_N, k: int = QUANT_K, dev: str = "cuda") -> list[dict]:
    """The quantized linear kernels at M rows of an N x K layer (FP8 rows need compute capability 8.9)."""
    from batonlm.kernels import int4 as i4
    from batonlm.kernels import int8 as i8
    from batonlm.kernels import quant as q

    g = torch.Generator(device=dev).manual_seed(m)
    x = torch.randn(m, k, device=dev, generator=g, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, generator=g, dtype=torch.bfloat16) / 64
    groups = k // QUANT_GROUP
    qweight = i4.pack_int4(torch.randint(0, 16, (k, n), device=dev, generator=g))
    scales = torch.rand(groups, n, device=dev, generator=g, dtype=torch.bfloat16) / 100
    zeros = torch.full((groups, n), 8, dtype=torch.int32, device=dev)
    cases = [
        ("bf16 matmul", "torch", lambda: x @ w.T),
        ("int4 gemm", "triton", lambda: i4.int4_dequant_matmul(x, qweight, scales, zeros, QUANT_GROUP)),
        ("int4 gemm", "torch reference", lambda: i4.int4_dequant_matmul_reference(x, qweight, scales, zeros, QUANT_GROUP)),
    ]
    xi_q, xi_s = i8.per_token_quant_int8(x)
    w_i8 = torch.randint(-128, 128, (n, k), device=dev, generator=g, dtype=torch.int8)
    w_i8_s = torch.rand(n, device=dev, generator=g) / 100
    cases += [
        ("int8 token quant", "triton", lambda: i8.per_token_quant_int8(x)),
        ("int8 token quant", "torch reference", lambda: i8.per_token_quant_int8_reference(x)),
        ("int8 w8a8 gemm", "triton", lambda: i8.int8_scaled_matmul(xi_q, xi_s, w_i8, w_i8_s, torch.bfloat16)),
        ("int8 w8a8 gemm", "torch reference",
         lambda: i8.int8_scaled_matmul_reference(xi_q, xi_s, w_i8, w_i8_s, torch.bfloat16)),
    ]
    if torch.cuda.get_device_capability() >= (8, 9):
        x_q, x_s = q.per_token_group_quant_fp8(x, QUANT_GROUP)
        w_q = (w * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        w_block_s = torch.rand(n // 128, k // 128, device=dev, generator=g) / 100
        xt_q, xt_s = q.per_token_quant_fp8(x)
        w_ch = torch.rand(n, device=dev, generator=g) / 100
        cases += [
            ("fp8 group quant", "triton", lambda: q.per_token_group_quant_fp8(x, QUANT_GROUP)),
            ("fp8 group quant", "torch reference", lambda: q.per_token_group_quant_fp8_reference(x, QUANT_GROUP)),
            ("fp8 block gemm", "triton",
             lambda: q.fp8_block_matmul(x_q, x_s, w_q, w_block_s, (128, 128), torch.bfloat16)),
            ("fp8 block gemm", "torch reference",
             lambda: q.fp8_block_matmul_reference(x_q, x_s, w_q, w_block_s, (128, 128), torch.bfloat16)),
            ("fp8 channel gemm", "triton", lambda: q.fp8_scaled_matmul(xt_q, xt_s, w_q, w_ch, torch.bfloat16)),
            ("fp8 channel gemm", "torch reference",
             lambda: q.fp8_scaled_matmul_reference(xt_q, xt_s, w_q, w_ch, torch.bfloat16)),
        ]
    size = f"{n}x{k}"
    return [{"op": op, "impl": impl, "batch": m, "size": size, "ms": round(cuda_ms(fn, iters), 4)} for op, impl, fn in cases]


def print_table(rows: list[dict]) -> None:
    print(f"{'op':<16} {'size':>9} {'batch':>5} {'impl':<24} {'ms':>9} {'vs triton':>9}")
    size = {id(r): str(r.get("vocab", r.get("size"))) for r in rows}
    triton_ms = {(r["op"], r["batch"], size[id(r)]): r["ms"] for r in rows if r["impl"] == "triton"}
    for r in sorted(rows, key=lambda r: (r["op"], size[id(r)], r["batch"], r["impl"] != "triton")):
        base = triton_ms.get((r["op"], r["batch"], size[id(r)]))
        ratio = f"{r['ms'] / base:>8.2f}x" if base else f"{'':>9}"
        print(f"{r['op']:<16} {size[id(r)]:>9} {r['batch']:>5} {r['impl']:<24} {r['ms']:>9.4f} {ratio}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("skipped: no CUDA device")
        return 0
    import triton

    rows = []
    for v in VOCABS:
        for b in BATCHES:
            rows += bench_shape(b, v, args.iters)
            print(f"done: batch {b}, vocabulary {v}", file=sys.stderr, flush=True)
    for m in BATCHES:
        rows += bench_quant(m, args.iters)
        print(f"done: quantized GEMMs, {m} rows", file=sys.stderr, flush=True)
    print_table(rows)
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "iters": args.iters,
        "params": {"temperature": TEMPERATURE, "top_k": TOP_K, "top_p": TOP_P, "min_p": MIN_P, "top_n": TOP_N},
        "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
