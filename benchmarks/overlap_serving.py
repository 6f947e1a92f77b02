"""Overlap vs normal loop under `batonlm bench` load, through the whole server.

Two servers on the same model (one with --disable-overlap) get the same load in alternating
rounds: the random dataset (fixed input/output lengths, EOS ignored), all requests at once with
`--max-concurrency` 1, 4, 16 and 64. Reported per concurrency and loop: TTFT and ITL (median,
p99) and output tokens/s from the client, and from the server's /metrics the scheduler's CPU
time per iteration (building batches, launching, processing results) and the device's compute
time per iteration. As in benchmarks/overlap.py:
    hidden CPU  = (median ITL normal - median ITL overlap) / scheduler CPU per iteration (aim: >= 0.8)
    hidden host = (mean ITL normal - mean ITL overlap) / (mean ITL normal - device per iteration)

    python benchmarks/overlap_serving.py [--concurrency 1 4 16 64] [--rounds 2] [MODEL flags]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

from batonlm.bench.server_process import ServerProcess

RESULTS = Path(__file__).resolve().parent / "results"
GAUGES = ("batonlm_scheduler_cpu_seconds", "batonlm_device_compute_seconds", "batonlm_scheduler_batches")


def scrape(base_url: str) -> dict[str, float]:
    text = httpx.get(base_url + "/metrics", timeout=30).text
    out = {}
    for name in GAUGES:
        m = re.search(rf"^{name}{{[^}}]*}} ([0-9.e+-]+)$", text, re.M)
        out[name] = float(m.group(1)) if m else 0.0
    return out


def bench(server: ServerProcess, concurrency: int, args: argparse.Namespace, out: Path) -> dict:
    before = scrape(server.base_url)
    cmd = [sys.executable, "-m", "batonlm", "bench", "--base-url", server.base_url,
           "--num-prompts", str(max(args.min_prompts, args.prompts_per_slot * concurrency)),
           "--max-concurrency", str(concurrency), "--request-rate", "inf",
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--random-range-ratio", "1.0", "--seed", "0", "--disable-progress-bar", "--output-json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"batonlm bench failed:\n{done.stdout}\n{done.stderr}")
    after = scrape(server.base_url)
    summary = json.loads(out.read_text())["summary"]
    assert summary["failed"] == 0, summary["errors"]
    batches = max(1.0, after["batonlm_scheduler_batches"] - before["batonlm_scheduler_batches"])
    return {
        "ttft_median_ms": summary["ttft_ms"]["median"],
        "ttft_p99_ms": summary["ttft_ms"]["p99"],
        "itl_median_ms": summary["itl_ms"]["median"],
        "itl_p99_ms": summary["itl_ms"]["p99"],
        "itl_mean_ms": summary["itl_ms"]["mean"],
        "tokens_per_s": summary["output_throughput"],
        "cpu_per_iter_ms": 1e3 * (after["batonlm_scheduler_cpu_seconds"] - before["batonlm_scheduler_cpu_seconds"]) / batches,
        "device_per_iter_ms": 1e3 * (after["batonlm_device_compute_seconds"]
                                     - before["batonlm_device_compute_seconds"]) / batches,
    }


def median_of(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--prompts-per-slot", type=int, default=4, help="requests per concurrency slot")
    ap.add_argument("--min-prompts", type=int, default=16)
    ap.add_argument("--output-json", default=str(RESULTS / "local" / "overlap_serving.json"))
    ap.add_argument("serve_args", nargs="*", help="extra `batonlm serve` arguments (e.g. a model path)")
    args = ap.parse_args()

    servers = {
        "normal": ServerProcess(*args.serve_args, "--disable-overlap"),
        "overlap": ServerProcess(*args.serve_args),
    }
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name, s in servers.items():  # warm-up
                bench(s, 2, argparse.Namespace(**{**vars(args), "min_prompts": 4, "prompts_per_slot": 1}),
                      Path(tmp) / f"warm-{name}.json")
            for c in args.concurrency:
                runs: dict[str, list[dict]] = {"normal": [], "overlap": []}
                for r in range(args.rounds):
                    for name, s in servers.items():
                        runs[name].append(bench(s, c, args, Path(tmp) / f"{name}-{c}-{r}.json"))
                n, o = median_of(runs["normal"]), median_of(runs["overlap"])
                host = n["itl_mean_ms"] - n["device_per_iter_ms"]
                rows.append({
                    "concurrency": c, "normal": n, "overlap": o,
                    "itl_ratio": o["itl_median_ms"] / n["itl_median_ms"],
                    "throughput_ratio": o["tokens_per_s"] / n["tokens_per_s"],
                    "host_per_iter_ms": host,
                    "hidden_cpu_fraction": (n["itl_median_ms"] - o["itl_median_ms"]) / n["cpu_per_iter_ms"],
                    "hidden_fraction": (n["itl_mean_ms"] - o["itl_mean_ms"]) / host if host > 0 else None,
                })
    finally:
        for s in servers.values():
            s.stop()

    print(f"\nbatonlm overlap vs normal under `batonlm bench` load: random dataset, {args.input_len} in / "
          f"{args.output_len} out, median of {args.rounds} rounds, {os.cpu_count()} CPUs\n")
    head = (f"{'conc':>4} | {'TTFT med ms':>15} | {'ITL med ms':>15} | {'ITL p99 ms':>15} | {'output tok/s':>15} | "
            f"{'o/n':>4} | {'sched CPU':>9} | {'device':>6} | {'host':>5} | {'hidden':>6} | {'hidden':>6}")
    print(head)
    print(f"{'':>4} | {'normal overlap':>15} | {'normal overlap':>15} | {'normal overlap':>15} | "
          f"{'normal overlap':>15} | {'tok/s':>4} | {'ms/iter':>9} | {'ms/it':>6} | {'ms/it':>5} | {'CPU':>6} | {'host':>6}")
    print("-" * len(head))
    for r in rows:
        n, o = r["normal"], r["overlap"]
        hidden = "n/a" if r["hidden_fraction"] is None else f"{100 * r['hidden_fraction']:.0f}%"
        print(f"{r['concurrency']:>4} | {n['ttft_median_ms']:>6.1f} {o['ttft_median_ms']:>8.1f} | "
              f"{n['itl_median_ms']:>6.2f} {o['itl_median_ms']:>8.2f} | {n['itl_p99_ms']:>6.2f} {o['itl_p99_ms']:>8.2f} | "
              f"{n['tokens_per_s']:>6.0f} {o['tokens_per_s']:>8.0f} | {r['throughput_ratio']:>4.2f} | "
              f"{n['cpu_per_iter_ms']:>9.3f} | {n['device_per_iter_ms']:>6.3f} | {r['host_per_iter_ms']:>5.2f} | "
              f"{100 * r['hidden_cpu_fraction']:>5.0f}% | {hidden:>6}")
    print("\nsched CPU: the scheduler's work per iteration (normal loop); device: the CPU worker's forward +")
    print("sampling per iteration; host: mean ITL - device (normal loop): the serial part the overlap loop can hide;")
    print("hidden CPU = (median ITL normal - median ITL overlap) / sched CPU (the aim: >= 80%);")
    print("hidden host = (mean ITL normal - mean ITL overlap) / host.")
    out = Path(args.output_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "overlap_serving",
        "input_len": args.input_len, "output_len": args.output_len, "rounds": args.rounds,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0]},
        "command": "python benchmarks/overlap_serving.py " + " ".join(sys.argv[1:]),
        "rows": rows,
    }, indent=2))
    plot(rows, out.with_suffix(".png"))
    print(f"\nwrote {out} and {out.with_suffix('.png')}")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conc = [r["concurrency"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for loop, style in (("normal", "o--"), ("overlap", "s-")):
        a.plot(conc, [r[loop]["itl_median_ms"] for r in rows], style, label=loop)
        b.plot(conc, [r[loop]["tokens_per_s"] for r in rows], style, label=loop)
    for ax, label in ((a, "median ITL (ms)"), (b, "output tokens/s")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(conc, [str(c) for c in conc])
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle("overlap vs normal loop under batonlm bench load")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
