"""The decode step alone: batonlm eager vs compiled (CPU) vs transformers, and the compile time.

For each model and batch size B, every row decodes one token on a context of `--context`
tokens. Timed, median of `--rounds` rounds of `--steps` steps, the three alternating in each round:

* batonlm eager: `ModelRunner.forward` of the decode batch (req-to-token write, model, logits);
* batonlm compiled: the same call with the compiled decode step (`CompiledDecode`) in place;
* transformers: the model's forward of B new tokens on a `DynamicCache` holding the context
  (what `generate` runs per step, without its sampling and bookkeeping).

Intra-op threads are what the CPU device worker would use for the model (1 below hidden size
256, else every core), for all three. Compile time is measured in fresh processes: cold (an
empty inductor cache) and cached (a second process on the cache the first one filled).

The bandwidth limit: a one-row step reads every weight once, so it cannot take less than the
weights' bytes over the rate they can be read at. The probe reads a buffer of the weights' size
as the steps do, again and again (`torch.sum` with the worker's threads, best of 20: from
memory, or partly from a last-level cache as large as the model, as the weights are), and each
model's row shows that limit and limit / step (1.0: at the limit). An earlier probe copied twice
the model (read plus write bytes), which understated a pure read: steps showed above 1.0.

With --profile, each model and batch size also prints the ops that took most of the step,
eager and compiled (the compiled step's generated kernels by name).

    python benchmarks/decode_step.py [--models stories260K llama-25m llama-100m] [--batch 1 16 64]
                                     [--dtype bfloat16] [--profile] [--gather]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import queue
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_transformers import RESULTS, ROOT, build_random_llama  # noqa: E402

from batonlm.config import EMBEDDED_MODEL  # noqa: E402
from batonlm.device.cpu_worker import keep_freed_memory  # noqa: E402
from batonlm.device.spec import cpu_worker_threads  # noqa: E402
from batonlm.kernels import cpu_attention  # noqa: E402
from batonlm.model_runner.compiled_decode import CompiledDecode  # noqa: E402
from batonlm.model_runner.forward_batch import ForwardBatch  # noqa: E402
from batonlm.model_runner.model_config import ModelConfig  # noqa: E402
from batonlm.model_runner.model_runner import ModelRunner  # noqa: E402

GATHER_ENV = "BATONLM_BENCH_GATHER"  # --gather, seen by the compile-time children too


def build(path: str, max_bs: int, context: int, dtype: torch.dtype = torch.float32) -> tuple[ModelRunner, CompiledDecode]:
    if os.environ.get(GATHER_ENV) == "1":  # the path before kernels/cpu_attention.py, for a side-by-side
        cpu_attention.supports = lambda kv_pool, softcap: False
    cfg = ModelConfig.from_hf(path)
    runner = ModelRunner(cfg, dtype=dtype, device="cpu", kv_capacity=max_bs * (context + 1),
                         num_req_slots=max_bs, context_length=context + 1, attention_backend="torch", sampler="torch")
    graphs = CompiledDecode(runner.model, runner.attn, max_bs=max_bs, max_context=context + 1,
                            cache_dir=os.environ["TORCHINDUCTOR_CACHE_DIR"])
    return runner, graphs


def _compile_child(path: str, max_bs: int, context: int, cache_dir: str, threads: int, dtype: torch.dtype,
                   out) -> None:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    torch.set_num_threads(threads)
    _, graphs = build(path, max_bs, context, dtype)
    t0 = time.perf_counter()
    graphs.prepare(lambda _: None)
    out.put(time.perf_counter() - t0)


def compile_seconds(path: str, max_bs: int, context: int, cache_dir: str, threads: int, dtype: torch.dtype) -> float:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_compile_child, args=(path, max_bs, context, cache_dir, threads, dtype, q))
    p.start()
    while True:  # the child's answer, or its death (a failed compile) instead of waiting forever
        try:
            seconds = q.get(timeout=2)
            break
        except queue.Empty:
            if not p.is_alive():
                raise RuntimeError(f"the compile child exited with {p.exitcode} (its traceback is above)") from None
    p.join()
    return seconds


def decode_batch(runner: ModelRunner, b: int, context: int) -> ForwardBatch:
    """b rows of `context` cached tokens (random K/V: the step's cost does not depend on them)."""
    for layer in range(runner.cfg.num_layers):
        runner.kv_pool.k[layer].normal_()
        runner.kv_pool.v[layer].normal_()
    for row in range(b):
        first = 1 + row * (context + 1)
        runner.req_to_token.table[row, :context] = torch.arange(first, first + context, device=runner.device)
    dev = runner.device
    loc = torch.tensor([1 + row * (context + 1) + context for row in range(b)], device=dev)
    ids = torch.randint(3, runner.cfg.vocab_size, (b,), device=dev)
    return ForwardBatch.build(loc, list(range(b)), [context] * b, [1] * b, dev, input_ids=ids)


def hf_step(model, b: int, context: int):
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        model(torch.randint(3, model.config.vocab_size, (b, context)), past_key_values=cache, use_cache=True)
    ids = torch.randint(3, model.config.vocab_size, (b, 1))

    def step():
        with torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True)
        cache.crop(-1)  # drop the new token: every step on the same context

    return step


def bandwidth_gbs(nbytes: int, threads: int) -> float:
    """Read bandwidth (GB/s) with `threads` threads: a sum over `nbytes`, read again and again as
    a step's weights are, best of 20."""
    torch.set_num_threads(threads)
    src = torch.ones(nbytes // 4)
    src.sum()
    best = float("inf")
    for _ in range(20):
        t0 = time.perf_counter()
        src.sum()
        best = min(best, time.perf_counter() - t0)
    return src.numel() * 4 / best / 1e9


def weight_bytes(runner: ModelRunner) -> int:
    """What a one-row step reads: every parameter but the embedding (one row of it is read),
    plus the LM head again when it is the tied embedding."""
    model = runner.model
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.model.embed_tokens.weight
    return total - (0 if model.lm_head is None else embed.numel() * embed.element_size())


def time_ms(fn, steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    return 1e3 * (time.perf_counter() - t0) / steps


def op_profile(fn, steps: int = 5, top: int = 8) -> list[tuple[str, float, float]]:
    """The ops (compiled: the generated kernels, each by name) that took most of `steps` calls of
    `fn`: (name, ms a step, share of the step's profiled time)."""
    from torch.profiler import profile

    with profile() as prof:
        for _ in range(steps):
            fn()
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    return [(e.key, e.self_cpu_time_total / steps / 1e3, e.self_cpu_time_total / total) for e in events[:top]]


def bench_model(name: str, path: str, batches: list[int], context: int, steps: int, rounds: int, tmp: str,
                dtype: torch.dtype = torch.float32, profile: bool = False) -> dict:
    from transformers import AutoModelForCausalLM

    cfg = ModelConfig.from_hf(path)
    threads = cpu_worker_threads(cfg)
    torch.set_num_threads(threads)
    cache_dir = str(Path(tmp) / f"inductor-{name}")
    max_bs = max(batches)
    cold = compile_seconds(path, max_bs, context, cache_dir, threads, dtype)
    cached = compile_seconds(path, max_bs, context, cache_dir, threads, dtype)

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    runner, graphs = build(path, max_bs, context, dtype)
    torch.compiler.set_stance("default")  # the previous model's graphs were checked as below
    graphs.prepare(lambda _: None)
    # As the device worker runs them (cpu_worker._check_only_differentiating_guards): only the
    # guards that tell the graphs apart are checked (the full check costs ~0.2 ms a call).
    torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    rows = {}
    for b in batches:
        batch = decode_batch(runner, b, context)
        hf_fn = hf_step(hf, b, context)

        def eager(batch=batch):
            runner.decode_graphs = None
            runner.forward(batch)

        def compiled(batch=batch):
            runner.decode_graphs = graphs
            runner.forward(batch)

        samples = {"eager": [], "compiled": [], "transformers": []}
        for fn in (eager, compiled, hf_fn):  # warm-up
            time_ms(fn, 3)
        for _ in range(rounds):
            samples["eager"].append(time_ms(eager, steps))
            samples["compiled"].append(time_ms(compiled, steps))
            samples["transformers"].append(time_ms(hf_fn, steps))
        rows[b] = {k: statistics.median(v) for k, v in samples.items()}
        if profile:
            for mode, fn in (("eager", eager), ("compiled", compiled)):
                print(f"\n{name}, {mode}, {b} rows: the ops that took most of the step (profiled)")
                for op, ms, share in op_profile(fn):
                    print(f"  {ms:8.3f} ms  {100 * share:5.1f}%  {op[:100]}")
    nbytes = weight_bytes(runner)
    gbs = bandwidth_gbs(nbytes, threads)
    return {"model": name, "threads": threads, "compile_s": {"cold": cold, "cached": cached,
            "graphs": graphs.describe()}, "step_ms": rows,
            "weights_mb": nbytes / 1e6, "bandwidth_gbs": gbs, "limit_ms": nbytes / gbs / 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["stories260K", "llama-25m", "llama-100m"],
                    choices=["stories260K", "llama-25m", "llama-30m", "llama-100m"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the weights' and the KV cache's dtype, batonlm's and transformers'")
    ap.add_argument("--profile", action="store_true",
                    help="also print each step's heaviest ops, the compiled step's generated kernels by name")
    ap.add_argument("--gather", action="store_true",
                    help="decode attention gathers each row's context and runs SDPA over the copy (the CPU "
                         "attention kernel off): run once with and once without for a side-by-side")
    ap.add_argument("--output-json", default=str(RESULTS / "local" / "decode_step.json"))
    args = ap.parse_args()
    # The device worker's allocator settings: without them glibc returns each step's freed
    # temporaries to the OS and the next step faults them in again (the eager step at 16 rows of
    # the 25M shape measured 30 instead of 19 ms here, beside a step that allocates less).
    keep_freed_memory()
    if args.gather:
        os.environ[GATHER_ENV] = "1"
    if args.profile:  # the generated kernels record themselves (compiled in: the cache differs)
        from torch._inductor import config as inductor_config  # not `import torch...`: torch would turn local

        inductor_config.cpp.enable_kernel_profile = True

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            path = EMBEDDED_MODEL if name == "stories260K" else build_random_llama(
                ROOT / "configs" / "bench-models" / f"{name}.json", Path(tmp) / name)
            results.append(bench_model(name, path, args.batch, args.context, args.steps, args.rounds, tmp,
                                       getattr(torch, args.dtype), args.profile))

    attention = "gathered" if args.gather else "read in place" if cpu_attention.available() else "gathered (no kernel)"
    print(f"\ndecode step on a context of {args.context} tokens, {args.dtype}, decode attention {attention}, median of {args.rounds} rounds x "
          f"{args.steps} steps; {os.cpu_count()} CPUs, torch {torch.__version__}\n")
    head = (f"{'model':<12} | {'batch':>5} | {'transformers ms':>15} | {'eager ms':>8} | {'compiled ms':>11} | "
            f"{'compiled/eager':>14} | {'compiled/transformers':>21}")
    print(head)
    print("-" * len(head))
    for r in results:
        for b, t in r["step_ms"].items():
            print(f"{r['model']:<12} | {b:>5} | {t['transformers']:>15.3f} | {t['eager']:>8.3f} | {t['compiled']:>11.3f} | "
                  f"{t['compiled'] / t['eager']:>14.2f} | {t['compiled'] / t['transformers']:>21.2f}")
    print()
    for r in results:
        one = r["step_ms"].get(1)
        at = f"; batch 1 compiled at {r['limit_ms'] / one['compiled']:.2f} of it, eager {r['limit_ms'] / one['eager']:.2f}" \
            if one else ""
        print(f"{r['model']}: {r['weights_mb']:.1f} MB of weights a step, {r['bandwidth_gbs']:.1f} GB/s read with "
              f"{r['threads']} thread(s): limit {r['limit_ms']:.3f} ms{at}")
    print()
    for r in results:
        c = r["compile_s"]
        print(f"{r['model']}: compiling the graphs for {c['graphs']} took {c['cold']:.1f} s cold, "
              f"{c['cached']:.1f} s from the cache ({r['threads']} intra-op thread(s))")
    out = Path(args.output_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "decode_step", "dtype": args.dtype, "attention": attention, "context": args.context, "steps": args.steps, "rounds": args.rounds,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "command": "python benchmarks/decode_step.py " + " ".join(sys.argv[1:]),
        "results": results,
    }, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
