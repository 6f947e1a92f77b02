"""How long heavy requests stall everyone else: /health latency while the server handles each
kind of heavy input the hostile-input probe found (a 4 MB body that ends in a 400, a prompt of
4 MB of text, many prompts, many stop strings), against /health latency at rest.

    python benchmarks/stall.py [--repeats 5] [--output-json PATH]
    python benchmarks/stall.py --corpus [--repeats 3]     # every case of tests/bad_inputs.py

Each case sends its request `--repeats` times while a second client polls /health every 10 ms;
the table shows the slowest /health answer (the stall) and the heavy request's own time. With
`--corpus` the cases are the bad-input corpus (every route, ~180 requests that must get a 4xx):
the table lists the ten longest stalls and the slowest /health over all of them.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import httpx

from batonlm.bench.server_process import ServerProcess

RESULTS = Path(__file__).resolve().parent / "results"
BIG = 4 * 1024 * 1024 - 4096  # just under the default --max-request-bytes

CASES = {
    "idle": None,
    "4 MB body, 400 (bad field at the end)": ("/v1/chat/completions", lambda: b'{"messages": [{"role": "user", '
                                              b'"content": "' + b"a " * (BIG // 2) + b'"}], "temperature": 9}'),
    "4 MB prompt text, 400 (too long)": ("/v1/completions", lambda: json.dumps({"prompt": "Once upon a time. " * (BIG // 18)}).encode()),
    "4 MB of token-id prompts, 400": ("/v1/completions", lambda: json.dumps({"prompt": [[1] * 600] * 1200}).encode()),
    "10,000 stop strings, 400": ("/generate", lambda: json.dumps({"text": "hi", "sampling_params": {"stop": ["x"] * 10_000}}).encode()),
}


def measure(url: str, path: str | None, body: bytes | None, repeats: int) -> dict:
    latencies: list[float] = []
    stop = threading.Event()

    def poll() -> None:
        with httpx.Client(timeout=60) as c:
            while not stop.is_set():
                t0 = time.perf_counter()
                c.get(url + "/health")
                latencies.append(time.perf_counter() - t0)
                time.sleep(0.01)

    poller = threading.Thread(target=poll)
    poller.start()
    while not latencies:  # polling before the request goes out, and after it
        time.sleep(0.001)
    times, statuses = [], []
    try:
        with httpx.Client(timeout=120) as c:
            for _ in range(repeats):
                if path is None:
                    time.sleep(0.5)
                    continue
                t0 = time.perf_counter()
                r = c.post(url + path, content=body, headers={"content-type": "application/json"})
                times.append(time.perf_counter() - t0)
                statuses.append(r.status_code)
    finally:
        n = len(latencies)
        while len(latencies) <= n:
            time.sleep(0.001)
        stop.set()
        poller.join()
    latencies.sort()
    return {
        "health_max_ms": 1000 * latencies[-1],
        "health_p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "health_median_ms": 1000 * latencies[len(latencies) // 2],
        "request_s": max(times) if times else 0.0,
        "statuses": sorted(set(statuses)),
    }


def measure_corpus(url: str, repeats: int) -> dict[str, dict]:
    """Each bad input of tests/bad_inputs.py, `repeats` times, /health polled meanwhile."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from bad_inputs import CORPUS

    rows = {}
    for i, (path, body, status, _, _) in enumerate(CORPUS):
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = measure(url, path, raw, repeats)
        r["as_expected"] = r["statuses"] == [status]
        rows[f"{i:3d} {path} {raw[:40]!r}"[:42]] = r
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--corpus", action="store_true", help="the bad-input corpus instead of the heavy inputs")
    ap.add_argument("--output-json", default=str(RESULTS / "local" / "stall.json"))
    args = ap.parse_args()
    server = ServerProcess()
    try:
        rows = measure_corpus(server.base_url, args.repeats) if args.corpus else {
            name: measure(server.base_url, *((case[0], case[1]()) if case else (None, None)), args.repeats)
            for name, case in CASES.items()}
    finally:
        server.stop()
    out: dict = rows
    if args.corpus:  # the ten longest stalls, and the whole corpus in one line
        worst = sorted(rows.items(), key=lambda kv: -kv[1]["health_max_ms"])
        unexpected = [n for n, r in worst if not r["as_expected"]]
        print(f"{len(rows)} cases; slowest /health over all of them: {worst[0][1]['health_max_ms']:.1f} ms; "
              f"cases not answered as expected: {unexpected}")
        rows = dict(worst[:10])
        out = rows | {"all": {"cases": len(worst), "health_max_ms": worst[0][1]["health_max_ms"],
                              "unexpected": unexpected}}
    print(f"{'case':42s} {'/health max ms':>15s} {'p99 ms':>8s} {'median ms':>10s} {'request s':>10s}  status")
    for name, r in rows.items():
        print(f"{name:42s} {r['health_max_ms']:15.1f} {r['health_p99_ms']:8.1f} {r['health_median_ms']:10.1f} "
              f"{r['request_s']:10.2f}  {r['statuses']}")
    Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output_json).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.output_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
