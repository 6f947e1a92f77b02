"""The three benchmarks of memory-aware scheduling, each with both sides in one run.

* prefix-cache: `batonlm bench`'s shared-prefix dataset (4 groups x 16 questions; 900-token
  system prompts + 100-token questions: 1K-token prompts, 90% shared; 32 new tokens), on two
  servers, one with --disable-radix-cache, alternating rounds: TTFT median and throughput.
* chunked-prefill: 16 streams decode (EOS ignored) while a 4K-token prompt arrives: their
  inter-token latency before it arrives (steady) and while it is computed (p99), for several
  chunk sizes and without chunking (--chunked-prefill-size -1).
* long-context: the embedded model with its context raised to 32768, --max-total-tokens 65536,
  16 concurrent /v1/completions without max_tokens: wall time and peak running requests. Run it
  on an older checkout too (PYTHONPATH=that checkout) to compare with admission by whole context.

    python benchmarks/memory_scheduling.py [--which prefix-cache chunked-prefill long-context]
        [--rounds 2] [--output-json PATH]

The models with a long context are the embedded one with max_position_embeddings raised (made in
a temporary directory): positions past 512 were never trained, which changes no cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from batonlm.bench.server_process import ServerProcess
from batonlm.config import EMBEDDED_MODEL

RESULTS = Path(__file__).resolve().parent / "results"
CORPUS = Path(EMBEDDED_MODEL).parents[1] / "bench" / "data" / "corpus.txt"


def long_context_model(tmp: Path, context: int) -> str:
    path = tmp / f"stories-{context}"
    shutil.copytree(EMBEDDED_MODEL, path, dirs_exist_ok=True)
    cfg = json.loads((path / "config.json").read_text())
    cfg["max_position_embeddings"] = context
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


def metric(url: str, name: str) -> float:
    m = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", httpx.get(url + "/metrics", timeout=30).text, re.M)
    return float(m.group(1)) if m else 0.0


# ---------------------------------------------------------------- (a) prefix cache
def bench_once(url: str, out: Path) -> dict:
    cmd = [sys.executable, "-m", "batonlm", "bench", "--base-url", url, "--dataset", "shared-prefix",
           "--shared-prefix-groups", "4", "--shared-prefix-questions", "16", "--shared-prefix-len", "900",
           "--shared-prefix-question-len", "100", "--random-output-len", "32", "--random-range-ratio", "1.0",
           "--request-rate", "inf", "--max-concurrency", "16", "--seed", "0", "--disable-progress-bar",
           "--output-json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"batonlm bench failed:\n{done.stdout}\n{done.stderr}")
    s = json.loads(out.read_text())["summary"]
    assert s["failed"] == 0, s["errors"]
    return {"ttft_median_ms": s["ttft_ms"]["median"], "ttft_p99_ms": s["ttft_ms"]["p99"],
            "output_tokens_per_s": s["output_throughput"], "requests_per_s": s["request_throughput"]}


def prefix_cache(tmp: Path, rounds: int) -> dict:
    model = long_context_model(tmp, 2048)
    servers = {"cache on": ServerProcess(model), "cache off": ServerProcess(model, "--disable-radix-cache")}
    runs: dict[str, list[dict]] = {k: [] for k in servers}
    try:
        for r in range(rounds):
            for name, s in servers.items():
                httpx.post(s.base_url + "/flush_cache", timeout=30)  # every round starts cold
                runs[name].append(bench_once(s.base_url, tmp / f"{name}-{r}.json"))
            runs["cache on"][-1]["hit_ratio"] = metric(servers["cache on"].base_url, "batonlm_prefix_cache_hit_ratio")
    finally:
        for s in servers.values():
            s.stop()
    med = {k: {m: statistics.median(x[m] for x in v) for m in v[0]} for k, v in runs.items()}
    on, off = med["cache on"], med["cache off"]
    med["ttft_off_over_on"] = off["ttft_median_ms"] / on["ttft_median_ms"]
    med["throughput_on_over_off"] = on["output_tokens_per_s"] / off["output_tokens_per_s"]
    return med


# ---------------------------------------------------------------- (b) chunked prefill
async def _stream(c: httpx.AsyncClient, url: str, body: dict, times: list[float]) -> None:
    async with c.stream("POST", url + "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())


async def _interference(url: str, long_prompt: list[int]) -> dict:
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(timeout=300, limits=limits) as c:
        streams = [[] for _ in range(16)]
        body = {"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True, "temperature": 0, "stream": True}
        tasks = [asyncio.create_task(_stream(c, url, body, t)) for t in streams]
        while min(len(t) for t in streams) < 200:  # all 16 decoding in step
            await asyncio.sleep(0.01)
        t_arrive = time.perf_counter()
        first: list[float] = []
        long_body = {"prompt": long_prompt, "max_tokens": 1, "stream": True}
        await _stream(c, url, long_body, first)
        t_done = first[0]
        await asyncio.sleep(0.5)  # the streams' first tokens after the long prompt
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    steady, during = [], []
    for times in streams:
        for a, b in zip(times, times[1:]):
            if b < t_arrive:
                steady.append(b - a)
            elif a < t_done:  # a gap that overlaps the long prompt's computation
                during.append(b - a)
    steady.sort()
    during.sort()
    return {"steady_itl_median_ms": 1e3 * steady[len(steady) // 2],
            "during_itl_p99_ms": 1e3 * during[min(len(during) - 1, int(0.99 * len(during)))],
            "during_itl_max_ms": 1e3 * during[-1], "long_prompt_ttft_ms": 1e3 * (t_done - t_arrive)}


def chunked_prefill(tmp: Path, rounds: int, sizes: list[int]) -> dict:
    model = long_context_model(tmp, 8192)
    rng_ids = [1] + [(7 * i) % 500 + 3 for i in range(4095)]
    out: dict = {}
    for size in sizes:
        name = "whole prompts" if size < 0 else f"chunks of {size}"
        s = ServerProcess(model, "--chunked-prefill-size", str(size))
        try:
            runs = [asyncio.run(_interference(s.base_url, rng_ids)) for _ in range(rounds)]
        finally:
            s.stop()
        out[name] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        out[name]["p99_over_steady"] = out[name]["during_itl_p99_ms"] / out[name]["steady_itl_median_ms"]
    return out


# ---------------------------------------------------------------- (c) long context, no max_tokens
async def _no_max_tokens(url: str, prompts: list[str]) -> dict:
    peak = 0
    done = asyncio.Event()

    async def watch() -> None:
        nonlocal peak
        async with httpx.AsyncClient(timeout=30) as c:
            while not done.is_set():
                text = (await c.get(url + "/metrics")).text
                m = re.search(r"^batonlm_num_requests_running(?:{[^}]*})? ([0-9.e+-]+)$", text, re.M)
                peak = max(peak, int(float(m.group(1)))) if m else peak
                await asyncio.sleep(0.05)

    watcher = asyncio.create_task(watch())
    t0 = time.perf_counter()
    latencies: list[float] = []

    async def one(c: httpx.AsyncClient, prompt: str) -> httpx.Response:
        r = await c.post(url + "/v1/completions", json={"prompt": prompt, "temperature": 0})
        latencies.append(time.perf_counter() - t0)
        return r

    async with httpx.AsyncClient(timeout=3600, limits=httpx.Limits(max_connections=32)) as c:
        answers = await asyncio.gather(*(one(c, p) for p in prompts))
    wall = time.perf_counter() - t0
    done.set()
    await watcher
    tokens = [a.json()["usage"]["completion_tokens"] for a in answers]
    latencies.sort()
    return {"wall_s": wall, "peak_running": peak, "completion_tokens": sum(tokens), "longest": max(tokens),
            "latency_median_s": latencies[len(latencies) // 2], "fifteen_done_s": latencies[-2]}


def long_context(tmp: Path) -> dict:
    model = long_context_model(tmp, 32768)
    lines = [line for line in CORPUS.read_text().splitlines() if line.strip()][:16]
    prompts = [" ".join(line.split()[:12]) for line in lines]
    s = ServerProcess(model, "--max-total-tokens", "65536")
    try:
        return asyncio.run(_no_max_tokens(s.base_url, prompts))
    finally:
        s.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--which", nargs="+", default=["prefix-cache", "chunked-prefill", "long-context"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--chunk-sizes", type=int, nargs="+", default=[32, 128, 512, -1], help="(b); -1: whole prompts")
    ap.add_argument("--output-json", default=str(RESULTS / "local" / "memory_scheduling.json"))
    args = ap.parse_args()
    results: dict = {"machine": {"python": platform.python_version(), "cpus": __import__("os").cpu_count()}}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if "prefix-cache" in args.which:
            r = results["prefix_cache"] = prefix_cache(tmp, args.rounds)
            print("(a) shared-prefix dataset, 64 requests of ~1K tokens (90% shared), 16 at a time")
            print(f"{'':12s} {'TTFT median ms':>15s} {'TTFT p99 ms':>12s} {'output tok/s':>13s} {'req/s':>7s}")
            for k in ("cache on", "cache off"):
                v = r[k]
                print(f"{k:12s} {v['ttft_median_ms']:15.1f} {v['ttft_p99_ms']:12.1f} {v['output_tokens_per_s']:13.1f} "
                      f"{v['requests_per_s']:7.2f}")
            print(f"TTFT off/on: {r['ttft_off_over_on']:.2f}x; throughput on/off: {r['throughput_on_over_off']:.2f}x; "
                  f"hit ratio {r['cache on'].get('hit_ratio', 0):.2f}")
        if "chunked-prefill" in args.which:
            r = results["chunked_prefill"] = chunked_prefill(tmp, args.rounds, args.chunk_sizes)
            print("(b) 16 streams decoding while a 4,096-token prompt arrives")
            print(f"{'':18s} {'steady ITL ms':>14s} {'ITL p99 during':>15s} {'max during':>11s} {'p99/steady':>11s} "
                  f"{'long TTFT ms':>13s}")
            for k, v in r.items():
                print(f"{k:18s} {v['steady_itl_median_ms']:14.2f} {v['during_itl_p99_ms']:15.2f} "
                      f"{v['during_itl_max_ms']:11.2f} {v['p99_over_steady']:11.2f} {v['long_prompt_ttft_ms']:13.1f}")
        if "long-context" in args.which:
            r = results["long_context"] = long_context(tmp)
            print("(c) context 32768, pool 65536, 16 concurrent completions without max_tokens")
            print(f"wall {r['wall_s']:.1f} s (15 of 16 done at {r['fifteen_done_s']:.1f} s, median latency "
                  f"{r['latency_median_s']:.1f} s), peak running {r['peak_running']}, {r['completion_tokens']} tokens "
                  f"(longest {r['longest']})")
    Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output_json).write_text(json.dumps(results, indent=1))
    print(f"wrote {args.output_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
