"""batonlm against llama.cpp's `llama-server` (a C++ engine) on the same fp32 weights: ITL at one
stream, throughput at 16 and 64 streams, TTFT on a shared 400-token prefix, idle memory.

The servers (batonlm with the compiled step, optionally eager too, and llama-server with one
slot per stream, once with its default f16 KV cache and once with fp32 KV like batonlm's) run
side by side; every measurement alternates between
them round by round, through the same HTTP client:
* ITL: one stream of `--new-tokens` greedy tokens (EOS ignored); the gaps between streamed
  tokens at the client, median and p90 over every round.
* throughput: N streams at once, each `--new-tokens` tokens; generated tokens / wall time.
* TTFT: a prompt of a 400-token prefix every request shares plus a few tokens of its own,
  one at a time (the prefix cached after the first, in both engines).
* RSS: the server's process tree (batonlm: frontend, scheduler, device worker), idle, after
  the rounds.
Every request bans the tokenizer's byte tokens (<0x00>..<0xFF>, logit_bias -100) in both
servers: a random-weight model emits them, and batonlm streams no text until the bytes form a
whole character (llama-server streams U+FFFD), which would leave nothing to time.

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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil

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


BYTE_BIAS: dict[str, int] = {}  # main() fills it: the byte tokens, banned


def stream_once(url: str, model: str, prompt: str, new_tokens: int) -> tuple[float, list[float], int]:
    """(TTFT s, gaps between tokens s, tokens) of one streamed greedy completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "logit_bias": BYTE_BIAS}
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


def throughput(url: str, model: str, prompt: str, new_tokens: int, streams: int) -> float:
    """Generated tokens per second of `streams` simultaneous streams."""
    with ThreadPoolExecutor(streams) as pool:
        t0 = time.perf_counter()
        counts = list(pool.map(lambda i: stream_once(url, model, f"{prompt} {i}", new_tokens)[2], range(streams)))
        return sum(counts) / (time.perf_counter() - t0)


def rss_mb(pid: int) -> float:
    proc = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)]) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-server", required=True, help="path to the llama-server binary")
    ap.add_argument("--gguf", required=True, help="the model converted to GGUF (f32)")
    ap.add_argument("--model", default=None, help="the batonlm model directory (default: the embedded stories260K)")
    ap.add_argument("--llama-threads", type=int, default=os.cpu_count(), help="llama-server -t (default: every core)")
    ap.add_argument("--eager", action="store_true", help="also batonlm with --compile off")
    ap.add_argument("--llama-kv", nargs="+", default=["f16", "f32"], help="llama-server KV cache types, one server each")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--concurrency", type=int, nargs="*", default=[16, 64])
    ap.add_argument("--prompt", default="Once upon a time, there was a little girl named Lily.")
    ap.add_argument("--output-json", default=str(RESULTS / "local" / "vs_llamacpp.json"))
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from batonlm.config import EMBEDDED_MODEL

    tok = AutoTokenizer.from_pretrained(args.model or EMBEDDED_MODEL)
    BYTE_BIAS.update({str(i): -100 for i in range(len(tok)) if tok.convert_ids_to_tokens(i).startswith("<0x")})
    slots = max([1, *args.concurrency])
    model_arg = [args.model] if args.model else []
    servers = {"batonlm (compiled)": (["batonlm", "serve", *model_arg, "--port", "31001", "--compile", "on"],
                                      "http://127.0.0.1:31001")}
    if args.eager:
        servers["batonlm (eager)"] = (["batonlm", "serve", *model_arg, "--port", "31002", "--compile", "off"],
                                      "http://127.0.0.1:31002")
    for i, kv in enumerate(args.llama_kv):
        servers[f"llama-server {kv} KV"] = (
            [args.llama_server, "-m", args.gguf, "--port", str(31003 + i), "-c", str(1024 * slots), "-np", str(slots),
             "-t", str(args.llama_threads), "--cache-type-k", kv, "--cache-type-v", kv, "--log-disable"],
            f"http://127.0.0.1:{31003 + i}")
    prefix = " ".join([args.prompt] * 30)  # ~400 tokens of the stories tokenizer
    procs = {}
    results = {name: {"ttft": [], "gaps": [], "tokens": [], "prefix_ttft": [],
                      "tok_s": {n: [] for n in args.concurrency}} for name in servers}
    try:
        for name, (cmd, url) in servers.items():  # one at a time: a compile takes both cores
            procs[name] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            wait_ready(url, procs[name])
        model_ids = {name: httpx.get(url + "/v1/models").json()["data"][0]["id"] for name, (_, url) in servers.items()}
        for name, (_, url) in servers.items():  # warm-up (and the shared prefix cached)
            stream_once(url, model_ids[name], args.prompt, 8)
            stream_once(url, model_ids[name], prefix, 1)
        for r in range(args.rounds):
            for name, (_, url) in servers.items():
                ttft, gaps, n = stream_once(url, model_ids[name], args.prompt, args.new_tokens)
                results[name]["ttft"].append(ttft)
                results[name]["gaps"] += gaps
                results[name]["tokens"].append(n)
                results[name]["prefix_ttft"].append(stream_once(url, model_ids[name], f"{prefix} {r}", 1)[0])
                for streams in args.concurrency:
                    results[name]["tok_s"][streams].append(
                        throughput(url, model_ids[name], args.prompt, args.new_tokens, streams))
        rss = {name: rss_mb(procs[name].pid) for name in servers}
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
            "prefix_ttft_median_ms": 1e3 * statistics.median(r["prefix_ttft"]),
            "tokens_per_request": statistics.median(r["tokens"]),
            "tok_s": {n: statistics.median(v) for n, v in r["tok_s"].items()},
            "tok_s_range": {n: [min(v), max(v)] for n, v in r["tok_s"].items()},
            "rss_mb": rss[name],
        }
    print(f"\n{args.new_tokens} new tokens a stream, greedy, EOS ignored, {args.rounds} rounds alternating; "
          f"{os.cpu_count()} CPUs; llama-server -t {args.llama_threads} -np {slots}\n")
    cols = "".join(f" | {f'tok/s @{n}':>11}" for n in args.concurrency)
    head = f"{'server':<22} | {'ITL ms':>7} | {'ITL p90':>7} | {'TTFT 400-prefix ms':>18} | {'RSS MB':>7}{cols}"
    print(head)
    print("-" * len(head))
    for name, s in summary.items():
        tput = "".join(f" | {s['tok_s'][n]:>11.0f}" for n in args.concurrency)
        print(f"{name:<22} | {s['itl_median_ms']:>7.3f} | {s['itl_p90_ms']:>7.3f} | {s['prefix_ttft_median_ms']:>18.1f} | "
              f"{s['rss_mb']:>7.0f}{tput}")
    print()
    for name, s in summary.items():
        for ref_name, ref in summary.items():
            if not name.startswith("batonlm") or not ref_name.startswith("llama-server"):
                continue
            ratios = ", ".join(f"tok/s @{n} {s['tok_s'][n] / ref['tok_s'][n]:.2f}x" for n in args.concurrency)
            print(f"{name} / {ref_name}: ITL {s['itl_median_ms'] / ref['itl_median_ms']:.2f}x, "
                  f"TTFT on the prefix {s['prefix_ttft_median_ms'] / ref['prefix_ttft_median_ms']:.2f}x, "
                  f"RSS {s['rss_mb'] / ref['rss_mb']:.2f}x, {ratios}")
    out = Path(args.output_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "vs_llamacpp", "new_tokens": args.new_tokens, "rounds": args.rounds,
        "llama_threads": args.llama_threads, "concurrency": args.concurrency,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "command": "python benchmarks/vs_llamacpp.py " + " ".join(sys.argv[1:]),
        "summary": summary,
    }, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
