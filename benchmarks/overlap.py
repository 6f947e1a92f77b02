"""Normal vs overlap event loop on stories260K, side by side in one run.

For each concurrency, the same workload (N requests arriving at once, 128 new tokens each,
greedy, EOS ignored) runs on one scheduler and its CPU device worker, alternating the normal
and overlap loops for several rounds. Reports inter-token latency (median, p99), output
tokens/s, the overlap/normal ratios, the scheduler's CPU time per iteration (building batches,
launching, processing results: what the overlap loop should hide) and the device's compute time
per iteration, plus how much of it the overlap loop hid, two ways:
    hidden CPU  = (median ITL normal - median ITL overlap) / scheduler CPU per iteration (normal)
                  -- the aim: >= 0.8;
    hidden host = (mean ITL normal - mean ITL overlap) / host per iteration, where
                  host = mean ITL (normal) - device time per iteration (normal): the scheduler's
                  CPU work plus the launch/result hand-offs between the processes, all of which
                  the normal loop puts on the critical path (stricter: it includes IPC wake-ups).

    python benchmarks/overlap.py [--concurrency 1 4 16 64] [--rounds 3] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import statistics
import sys
import time
from io import StringIO
from pathlib import Path

from batonlm.config import EMBEDDED_MODEL, ServerArgs
from batonlm.ipc.messages import GenerateRequest
from batonlm.sampling_params import SamplingParams
from batonlm.scheduler.local_io import LocalIO
from batonlm.scheduler.process import build_scheduler

RESULTS = Path(__file__).resolve().parent / "results"
PROMPTS = ["Once upon a time", "Lily and Tom went to the park.", "The little dog", "One day, a bird"]


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def run_once(sched, io: LocalIO, prompts: list[list[int]], concurrency: int, new_tokens: int, overlap: bool) -> dict:
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i in range(concurrency):
        io.submit(GenerateRequest(f"r{i}", prompts[i % len(prompts)], params), sched.iteration)
    t_before = sched.timing.as_dict()
    compute_before = getattr(sched.device, "compute_s", 0.0)
    t0 = time.perf_counter()
    (sched.event_loop_overlap if overlap else sched.event_loop_normal)()
    wall = time.perf_counter() - t0
    t_after = sched.timing.as_dict()
    delta = {k: t_after[k] - t_before[k] for k in t_after}
    itl = []
    for rec in io.records.values():
        assert len(rec.token_ids) == new_tokens
        itl += [b - a for a, b in zip(rec.token_times, rec.token_times[1:])]
    io.records.clear()
    iters = delta["batches"]
    return {
        "wall_s": wall,
        "itl_median_ms": 1e3 * statistics.median(itl),
        "itl_p99_ms": 1e3 * percentile(itl, 99),
        "itl_mean_ms": 1e3 * statistics.fmean(itl),
        "tokens_per_s": concurrency * new_tokens / wall,
        "batches": iters,
        "cpu_per_iter_ms": 1e3 * delta["cpu_s"] / iters,
        "schedule_per_iter_ms": 1e3 * delta["schedule_s"] / iters,
        "launch_per_iter_ms": 1e3 * delta["launch_s"] / iters,
        "process_per_iter_ms": 1e3 * delta["process_s"] / iters,
        "wait_per_iter_ms": 1e3 * delta["wait_s"] / iters,
        "device_per_iter_ms": 1e3 * (getattr(sched.device, "compute_s", 0.0) - compute_before) / iters,
    }


def device_profile(model: str, prompts: list[list[int]], concurrency: int, new_tokens: int) -> str:
    """Where the device's time goes: torch ops of the same workload, run in one process
    (the inline device) at one intra-op thread, as in the worker."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(1)
    io = LocalIO(encode=True)
    sched, _ = build_scheduler(ServerArgs(model=model, max_running_requests=concurrency, cpu_device_worker="inline"), io)
    io.bind(lambda: sched.iteration)
    run_once(sched, io, prompts, concurrency, 8, overlap=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_once(sched, io, prompts, concurrency, new_tokens, overlap=True)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
    return f"Device (torch ops, concurrency {concurrency}, {new_tokens} tokens, inline device):\n{table}"


def median_of(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=EMBEDDED_MODEL)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="cProfile the scheduler loop (overlap, top concurrency)")
    ap.add_argument("--output-json", default=str(RESULTS / "local" / "overlap.json"))
    ap.add_argument("--cpu-worker-threads", type=int, default=None)
    args = ap.parse_args()

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    prompts = [tok(p).input_ids for p in PROMPTS]
    io = LocalIO(encode=True)
    server_args = ServerArgs(model=args.model, max_running_requests=max(args.concurrency),
                             cpu_worker_threads=args.cpu_worker_threads)
    sched, info = build_scheduler(server_args, io)
    io.bind(lambda: sched.iteration)
    rows = []
    try:
        # Warm-up: first forwards allocate and JIT whatever torch caches.
        run_once(sched, io, prompts, max(args.concurrency), 16, overlap=True)
        for c in args.concurrency:
            normal_runs, overlap_runs = [], []
            for _ in range(args.rounds):
                normal_runs.append(run_once(sched, io, prompts, c, args.new_tokens, overlap=False))
                overlap_runs.append(run_once(sched, io, prompts, c, args.new_tokens, overlap=True))
            n, o = median_of(normal_runs), median_of(overlap_runs)
            rows.append({
                "concurrency": c,
                "normal": n,
                "overlap": o,
                "itl_ratio": o["itl_median_ms"] / n["itl_median_ms"],
                "throughput_ratio": o["tokens_per_s"] / n["tokens_per_s"],
                "host_per_iter_ms": n["itl_mean_ms"] - n["device_per_iter_ms"],
                "hidden_cpu_fraction": (n["itl_median_ms"] - o["itl_median_ms"]) / n["cpu_per_iter_ms"],
                "hidden_fraction": (n["itl_mean_ms"] - o["itl_mean_ms"]) / (n["itl_mean_ms"] - n["device_per_iter_ms"]),
                "ideal_itl_ratio": max(n["device_per_iter_ms"], n["itl_mean_ms"] - n["device_per_iter_ms"])
                / n["itl_mean_ms"],
            })
        profile_text = None
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            run_once(sched, io, prompts, max(args.concurrency), args.new_tokens, overlap=True)
            prof.disable()
            s = StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(12)
            profile_text = "Scheduler process (cProfile, overlap loop):\n" + s.getvalue()
    finally:
        sched.device.close()
    if args.profile:
        profile_text += "\n" + device_profile(args.model, prompts, max(args.concurrency), args.new_tokens)

    print(f"\nbatonlm overlap benchmark: {Path(args.model).name}, {args.new_tokens} new tokens per request, "
          f"median of {args.rounds} rounds, {os.cpu_count()} CPUs\n")
    head = (f"{'conc':>4} | {'ITL median ms':>15} | {'ITL p99 ms':>15} | {'output tokens/s':>15} | "
            f"{'o/n':>4} | {'o/n':>4} | {'sched CPU':>9} | {'device':>6} | {'host':>5} | {'hidden':>6} | {'hidden':>6}")
    print(head)
    print(f"{'':>4} | {'normal overlap':>15} | {'normal overlap':>15} | {'normal overlap':>15} | "
          f"{'ITL':>4} | {'tok/s':>4} | {'ms/iter':>9} | {'ms/it':>6} | {'ms/it':>5} | {'CPU':>6} | {'host':>6}")
    print("-" * len(head))
    for r in rows:
        n, o = r["normal"], r["overlap"]
        print(f"{r['concurrency']:>4} | {n['itl_median_ms']:>6.3f} {o['itl_median_ms']:>8.3f} | "
              f"{n['itl_p99_ms']:>6.3f} {o['itl_p99_ms']:>8.3f} | {n['tokens_per_s']:>6.0f} {o['tokens_per_s']:>8.0f} | "
              f"{r['itl_ratio']:>4.2f} | {r['throughput_ratio']:>4.2f} | {n['cpu_per_iter_ms']:>9.3f} | "
              f"{n['device_per_iter_ms']:>6.3f} | {r['host_per_iter_ms']:>5.3f} | "
              f"{100 * r['hidden_cpu_fraction']:>5.0f}% | {100 * r['hidden_fraction']:>5.0f}%")
    print("\nsched CPU: the scheduler's own work per iteration in the normal loop (schedule + launch + process);")
    print("device: the worker's forward + sampling per iteration; host: mean ITL - device (normal loop);")
    print("hidden CPU = (median ITL normal - median ITL overlap) / sched CPU (the aim: >= 80%);")
    print("hidden host = (mean ITL normal - mean ITL overlap) / host. ITL o/n compares medians.")
    for r in rows:
        o = r["overlap"]
        print(f"  c={r['concurrency']:>3} overlap breakdown per iteration (ms): schedule {o['schedule_per_iter_ms']:.3f}, "
              f"launch {o['launch_per_iter_ms']:.3f}, process {o['process_per_iter_ms']:.3f}, "
              f"wait {o['wait_per_iter_ms']:.3f}, device {o['device_per_iter_ms']:.3f}")
    if profile_text:
        print("\nWhere the time goes\n" + profile_text)
    out = Path(args.output_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "overlap",
        "model": Path(args.model).name,
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0]},
        "command": "python benchmarks/overlap.py " + " ".join(sys.argv[1:]),
        "rows": rows,
        "profile": profile_text,
    }, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
