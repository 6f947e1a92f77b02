"""The GPU decode path in one run (part of benchmarks/gpu_check.sh; needs a CUDA device).

1. Greedy equality: the fast path (Triton attention, CUDA graphs, Triton sampler) against the
   reference path (torch attention, eager step, torch sampler), overlap loop, on the embedded
   stories260K (fp32) and a random ~32M Llama in bfloat16. fp32 must match token for token;
   bf16 is reported (batch shapes may round differently).
2. Normal vs overlap loop, CUDA graphs on: inter-token latency and tokens/s at 1 / 8 / 64
   streams (stories260K, 128 new tokens, greedy).
3. Decode step time, graphs vs eager, at batch 1 / 8 / 64 on a 128-token context, against the
   HBM roofline: the bytes one step must read (weights + each row's KV) over the copy
   bandwidth measured on this device.

Writes benchmarks/results/gpu_decode.json.

    python benchmarks/gpu_decode.py
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_step import decode_batch  # noqa: E402
from overlap import run_once  # noqa: E402
from vs_transformers import RESULTS, ROOT, build_random_llama  # noqa: E402

from batonlm.config import EMBEDDED_MODEL, ServerArgs  # noqa: E402
from batonlm.ipc.messages import GenerateRequest  # noqa: E402
from batonlm.sampling_params import SamplingParams  # noqa: E402
from batonlm.scheduler.local_io import LocalIO  # noqa: E402
from batonlm.scheduler.process import build_scheduler  # noqa: E402

REFERENCE = {"attention_backend": "torch", "disable_cuda_graph": True, "sampler": "torch"}
FAST = {"attention_backend": "triton", "sampler": "triton"}  # CUDA graphs: on by default


def scheduler(model: str, **args):
    io = LocalIO()
    sched, _ = build_scheduler(ServerArgs(model=model, device="cuda", max_running_requests=64, **args), io)
    io.bind(lambda: sched.iteration)
    return sched, io


def greedy(model: str, prompts: list[list[int]], new_tokens: int, **args) -> list[list[int]]:
    sched, io = scheduler(model, **args)
    try:
        params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        for i, p in enumerate(prompts):
            io.submit(GenerateRequest(f"r{i}", p, params), sched.iteration + i)
        sched.event_loop_overlap()
        return [io.records[f"r{i}"].token_ids for i in range(len(prompts))]
    finally:
        sched.device.close()


def equality(name: str, model: str, dtype: str, prompts: list[list[int]]) -> dict:
    ref = greedy(model, prompts, 64, dtype=dtype, **REFERENCE)
    fast = greedy(model, prompts, 64, dtype=dtype, **FAST)
    same_tokens = sum(a == b for r, f in zip(ref, fast) for a, b in zip(r, f))
    return {"model": name, "dtype": dtype, "sequences_equal": sum(r == f for r, f in zip(ref, fast)),
            "sequences": len(prompts), "tokens_equal_fraction": same_tokens / sum(len(r) for r in ref)}


def itl(model: str, prompts: list[list[int]], concurrency: list[int], rounds: int) -> list[dict]:
    sched, io = scheduler(model, **FAST)
    rows = []
    try:
        run_once(sched, io, prompts, 4, 8, overlap=True)  # warm-up
        for c in concurrency:
            runs = {False: [], True: []}
            for _ in range(rounds):
                for overlap in (False, True):
                    runs[overlap].append(run_once(sched, io, prompts, c, 128, overlap=overlap))
            med = {o: {k: statistics.median(r[k] for r in runs[o]) for k in ("itl_median_ms", "tokens_per_s")}
                   for o in runs}
            rows.append({"concurrency": c, "normal": med[False], "overlap": med[True]})
    finally:
        sched.device.close()
    return rows


def copy_bandwidth() -> float:
    """Bytes/s of a large device-to-device copy (read + write), the practical HBM roofline."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * x.numel() * 10 / (time.perf_counter() - t0)


def step_vs_roofline(name: str, model: str, dtype: str, batches: list[int], bandwidth: float) -> list[dict]:
    sched, _ = scheduler(model, dtype=dtype, **FAST)
    rows = []
    try:
        runner = sched.device.executor.runner
        graphs = runner.decode_graphs
        weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        kv = runner.kv_pool
        kv_token_bytes = 2 * len(kv.k) * kv.k[0].shape[0] * kv.k[0].shape[2] * kv.k[0].element_size()
        with torch.inference_mode():
            for b in batches:
                batch = decode_batch(runner, b, 128)
                times = {}
                for mode in ("eager", "graphs"):
                    runner.decode_graphs = graphs if mode == "graphs" else None
                    for _ in range(5):
                        runner.forward(batch)
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(50):
                        runner.forward(batch)
                    torch.cuda.synchronize()
                    times[mode] = (time.perf_counter() - t0) / 50
                step_bytes = weight_bytes + b * 129 * kv_token_bytes
                roofline_s = step_bytes / bandwidth
                rows.append({"model": name, "dtype": dtype, "batch": b, "eager_ms": 1e3 * times["eager"],
                             "graphs_ms": 1e3 * times["graphs"], "roofline_ms": 1e3 * roofline_s,
                             "tokens_per_s": b / times["graphs"], "roofline_tokens_per_s": b / roofline_s,
                             "fraction_of_roofline": roofline_s / times["graphs"]})
        runner.decode_graphs = graphs
    finally:
        sched.device.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--output-json", default=str(RESULTS / "local" / "gpu_decode.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_decode: no CUDA device; nothing measured")
        return
    import random

    rng = random.Random(0)
    prompts = [[1] + [rng.randrange(3, 512) for _ in range(rng.randint(8, 120))] for _ in range(16)]
    with tempfile.TemporaryDirectory() as tmp:
        bf16 = build_random_llama(ROOT / "configs" / "bench-models" / "llama-30m.json", Path(tmp) / "llama-30m")
        eq = [equality("stories260K", EMBEDDED_MODEL, "float32", prompts), equality("llama-30m", bf16, "bfloat16", prompts)]
        bandwidth = copy_bandwidth()
        steps = (step_vs_roofline("stories260K", EMBEDDED_MODEL, "float32", [1, 8, 64], bandwidth)
                 + step_vs_roofline("llama-30m", bf16, "bfloat16", [1, 8, 64], bandwidth))
    loops = itl(EMBEDDED_MODEL, prompts, [1, 8, 64], args.rounds)

    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; copy bandwidth {bandwidth / 1e12:.2f} TB/s\n")
    for e in eq:
        print(f"greedy, fast path vs reference: {e['model']} {e['dtype']}: {e['sequences_equal']}/{e['sequences']} "
              f"sequences equal, {100 * e['tokens_equal_fraction']:.1f}% of tokens")
    print(f"\n{'streams':>7} | {'ITL ms normal':>13} | {'ITL ms overlap':>14} | {'tok/s normal':>12} | {'tok/s overlap':>13}")
    for r in loops:
        n, o = r["normal"], r["overlap"]
        print(f"{r['concurrency']:>7} | {n['itl_median_ms']:>13.3f} | {o['itl_median_ms']:>14.3f} | "
              f"{n['tokens_per_s']:>12.0f} | {o['tokens_per_s']:>13.0f}")
    print(f"\n{'model':<12} | {'dtype':<8} | {'batch':>5} | {'eager ms':>8} | {'graphs ms':>9} | {'roofline ms':>11} | "
          f"{'tok/s':>8} | {'of roofline':>11}")
    for s in steps:
        print(f"{s['model']:<12} | {s['dtype']:<8} | {s['batch']:>5} | {s['eager_ms']:>8.3f} | {s['graphs_ms']:>9.3f} | "
              f"{s['roofline_ms']:>11.4f} | {s['tokens_per_s']:>8.0f} | {100 * s['fraction_of_roofline']:>10.1f}%")
    out = Path(args.output_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "gpu_decode", "device": torch.cuda.get_device_name(),
                               "torch": torch.__version__, "copy_bandwidth_bytes_per_s": bandwidth,
                               "greedy_equality": eq, "loops": loops, "decode_step": steps}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
