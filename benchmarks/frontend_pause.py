"""The frontend paused for a long time under load: SIGSTOP of `batonlm serve`'s main process (what
a long GC pause, swap or a debugger do) for --pause seconds while --streams streams decode, then
SIGCONT. The scheduler must pause decoding while its outputs cannot be sent (not exit), and every
stream must complete or end with an error event; the server must answer /health afterwards.

    python benchmarks/frontend_pause.py [--streams 128] [--pause 90] [--output-json PATH]

tests/integration/test_surface_faults.py checks the mechanism in seconds (8 streams, paused until
the scheduler says so); this is the issue's full case. Prints how each stream ended, the pause
as the scheduler logged it, and the time to finish after SIGCONT.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from batonlm.bench.server_process import ServerProcess, requests_in_server

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=128)
    ap.add_argument("--pause", type=float, default=90.0)
    ap.add_argument("--max-tokens", type=int, default=480)
    ap.add_argument("--output-json", default=str(RESULTS / "local" / "frontend_pause.json"))
    args = ap.parse_args()
    server = ServerProcess("--max-running-requests", str(args.streams), "--compile", "off")
    ends: list[str] = []
    tokens: list[int] = []

    def stream() -> None:
        body = {"prompt": "Once", "max_tokens": args.max_tokens, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        try:
            with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=args.pause + 600) as r:
                lines = [line for line in r.iter_lines() if line.startswith("data: ")]
            events = [json.loads(line[6:]) for line in lines if line != "data: [DONE]"]
            if events and "error" in events[-1]:
                ends.append("error event")
            elif lines and lines[-1] == "data: [DONE]":
                ends.append("completed")
                tokens.append(events[-1]["usage"]["completion_tokens"])
            else:
                ends.append("cut")
        except httpx.HTTPError as e:
            ends.append(type(e).__name__)

    try:
        threads = [threading.Thread(target=stream, daemon=True) for _ in range(args.streams)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while requests_in_server(server.base_url, ("running",)) < args.streams:  # every stream decoding
            if time.monotonic() > deadline or not any(t.is_alive() for t in threads):
                raise RuntimeError(f"the streams never all ran (they ended: {Counter(ends)})")
            time.sleep(0.05)
        os.kill(server.proc.pid, signal.SIGSTOP)
        time.sleep(args.pause)
        os.kill(server.proc.pid, signal.SIGCONT)
        t0 = time.monotonic()
        for t in threads:
            t.join(args.pause + 600)
        finish_s = time.monotonic() - t0
        health = httpx.get(server.base_url + "/health", timeout=30).status_code
        alive = server.proc.poll() is None
    finally:
        code = server.stop()
    log = server.log()
    out = {
        "streams": args.streams, "pause_s": args.pause, "ends": dict(Counter(ends)),
        "completed_with_all_tokens": sum(n == args.max_tokens for n in tokens),
        "finish_after_sigcont_s": round(finish_s, 1), "health_after": health, "alive_after": alive,
        "paused_logged": "decoding paused" in log, "resumed_logged": "decoding resumed" in log, "exit_code": code,
    }
    for k, v in out.items():
        print(f"{k:28s} {v}")
    Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output_json).write_text(json.dumps(out, indent=1))
    ok = out["ends"] == {"completed": args.streams} or set(out["ends"]) <= {"completed", "error event"}
    return 0 if ok and alive and health == 200 else 1


if __name__ == "__main__":
    sys.exit(main())
