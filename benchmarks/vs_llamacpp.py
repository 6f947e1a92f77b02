"""Serving inter-token latency at one stream: batonlm (compiled and eager decode step) against
llama.cpp's `llama-server` (a C++ engine) on the same fp32 weights.

The three servers run side by side; each round streams the same completion (greedy, EOS
ignored, `--new-tokens` tokens) from each in turn, one request at a time, through the same
HTTP client. Measured at the client: the gaps between streamed tokens (ITL, median and p90 of
all gaps of all rounds) and the time to the first token.

llama-server is not part of batonlm: build it from the llama-cpp-python source distribution
(see docs/benchmarks.md) and convert the model with its `convert_hf_to_gguf.py --outtype f32`.

    python benchmarks/vs_llamacpp.py --llama-server PATH/llama-server --gguf stories260K-f32.gguf
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server for {url} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready within {timeout:.0f} s")


def stream_once(url: str, model: str, prompt: str, new_tokens: int) -> tuple[float, list[float], int]:
    """(TTFT s, gaps between tokens s, tokens) of one streamed greedy completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True}
    stamps = []
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0].get("text"):
                stamps.append(time.perf_counter())
    return stamps[0] - t0, [b - a for a, b in zip(stamps, stamps[1:])], len(stamps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-server", required=True, help="path to the llama-server binary")
    ap.add_argument("--gguf", required=True, help="the model converted to GGUF (f32)")
    ap.add_argument("--model", default=None, help="the batonlm model directory (default: the embedded stories260K)")
    ap.add_argument("--llama-threads", type=int, default=os.cpu_count(), help="llama-server -t (default: every core)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt", default="Once upon a time, there was a little girl named Lily.")
    ap.add_argument("--output-json", default=str(RESULTS / "local" / "vs_llamacpp.json"))
    args = ap.parse_args()

    servers = {
        "batonlm (compiled)": (["batonlm", "serve", *([args.model] if args.model else []), "--port", "31001",
                                "--compile", "on"], "http://127.0.0.1:31001"),
        "batonlm (eager)": (["batonlm", "serve", *([args.model] if args.model else []), "--port", "31002",
                             "--compile", "off"], "http://127.0.0.1:31002"),
        "llama-server": ([args.llama_server, "-m", args.gguf, "--port", "31003", "-c", "2048", "-np", "1",
                          "-t", str(args.llama_threads), "--log-disable"], "http://127.0.0.1:31003"),
    }
    procs = {}
    try:
        for name, (cmd, url) in servers.items():  # one at a time: a compile takes both cores
            procs[name] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            wait_ready(url, procs[name])
        model_ids = {name: httpx.get(url + "/v1/models").json()["data"][0]["id"] for name, (_, url) in servers.items()}
        for name, (_, url) in servers.items():  # warm-up
            stream_once(url, model_ids[name], args.prompt, 8)
        results = {name: {"ttft": [], "gaps": [], "tokens": []} for name in servers}
        for _ in range(args.rounds):
            for name, (_, url) in servers.items():
                ttft, gaps, n = stream_once(url, model_ids[name], args.prompt, args.new_tokens)
                results[name]["ttft"].append(ttft)
                results[name]["gaps"] += gaps
                results[name]["tokens"].append(n)
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            p.wait(timeout=30)

    summary = {}
    for name, r in results.items():
        gaps = sorted(r["gaps"])
        summary[name] = {
            "itl_median_ms": 1e3 * statistics.median(gaps),
            "itl_p90_ms": 1e3 * gaps[int(0.9 * (len(gaps) - 1))],
            "ttft_median_ms": 1e3 * statistics.median(r["ttft"]),
            "tokens_per_request": statistics.median(r["tokens"]),
        }
    ref = summary["llama-server"]["itl_median_ms"]
    print(f"\none stream, {args.new_tokens} new tokens, greedy, EOS ignored, {args.rounds} rounds; "
          f"{os.cpu_count()} CPUs; llama-server -t {args.llama_threads}\n")
    head = f"{'server':<20} | {'ITL median ms':>13} | {'ITL p90 ms':>10} | {'TTFT ms':>8} | {'tokens':>6} | {'ITL / llama-server':>18}"
    print(head)
    print("-" * len(head))
    for name, s in summary.items():
        print(f"{name:<20} | {s['itl_median_ms']:>13.3f} | {s['itl_p90_ms']:>10.3f} | {s['ttft_median_ms']:>8.1f} | "
              f"{s['tokens_per_request']:>6.0f} | {s['itl_median_ms'] / ref:>17.2f}x")
    out = Path(args.output_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "vs_llamacpp", "new_tokens": args.new_tokens, "rounds": args.rounds,
        "llama_threads": args.llama_threads,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "command": "python benchmarks/vs_llamacpp.py " + " ".join(sys.argv[1:]),
        "summary": summary,
    }, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
