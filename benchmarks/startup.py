"""Start-up time of `batonlm serve` with the compiled decode step: a cold start, a warm one, and
the presets one after another on the same compile cache.

Each start is a fresh `batonlm serve` process on a fresh port, timed from the process's launch
to the first 200 from /health (the server listens from its ready line on), then stopped with
SIGTERM. The compile cache is a new directory, so the first start is cold; every later one may
reuse what is in it. Per start: the files it added to the cache (0: it compiled nothing, every
graph came from the cache), and the seconds its "decode step ready" line states (tracing the
graphs plus compiling or loading them).

    python benchmarks/startup.py [--model PATH] [--rounds 2] [--json FILE]

Runs: default (cold), default (warm), then configs/latency.yaml and configs/throughput.yaml,
`--rounds` times over (the cold start only once). Takes ~2 min on 2 cores with stories260K.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
PRESETS = {"default": "configs/default.yaml", "latency": "configs/latency.yaml", "throughput": "configs/throughput.yaml"}
READY_TIMEOUT_S = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(preset: str, cache: str, model: str | None, log_path: Path) -> dict:
    """One start to ready and its stop: seconds to ready, files added to the cache, the step's
    stated seconds."""
    before = _files(cache)
    port = _free_port()
    cmd = [sys.executable, "-m", "batonlm", "serve", "--config", str(ROOT / PRESETS[preset]), "--port", str(port),
           "--compile", "on", "--compile-cache-dir", cache, *(["--model", model] if model else [])]
    with open(log_path, "w") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        ready = None
        try:
            while time.perf_counter() - t0 < READY_TIMEOUT_S and proc.poll() is None:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                        ready = time.perf_counter() - t0
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    text = log_path.read_text()
    if ready is None:
        raise RuntimeError(f"{preset}: not ready (log: {log_path})\n{text[-2000:]}")
    step = re.search(r"decode step ready: .*?, ([0-9.]+) s", text)
    return {"preset": preset, "ready_s": ready, "new_cache_files": len(_files(cache) - before),
            "step_s": float(step.group(1)) if step else None}


def _files(cache: str) -> set[Path]:
    return set(Path(cache).rglob("*")) if Path(cache).exists() else set()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model directory (default: the embedded stories260K)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None, metavar="FILE")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="batonlm-startup-") as tmp:
        cache = str(Path(tmp) / "inductor")
        runs = [("default", "cold")] + [(p, "warm") for _ in range(args.rounds) for p in PRESETS]
        for i, (preset, kind) in enumerate(runs):
            row = {**start(preset, cache, args.model, Path(tmp) / f"{i}.log"), "cache": kind}
            rows.append(row)
            print(f"{preset:<11} {kind:<5} ready in {row['ready_s']:6.1f} s   decode step {row['step_s']} s   "
                  f"files added to the cache: {row['new_cache_files']}", flush=True)
    warm = [r["ready_s"] for r in rows if r["cache"] == "warm"]
    print(f"\nwarm starts: {min(warm):.1f}-{max(warm):.1f} s to ready; cold: {rows[0]['ready_s']:.1f} s "
          f"({os.cpu_count()} CPUs)")
    if args.json:
        Path(args.json).write_text(json.dumps({"benchmark": "startup", "model": args.model or "stories260K",
                                               "command": "python benchmarks/startup.py " + " ".join(sys.argv[1:]),
                                               "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
