"""Stop `batonlm serve` with a signal at a chosen moment and report how it ended: the exit code,
how long it took, which of its processes were left, what its streams got. Used by
tests/integration/test_signal_matrix.py and benchmarks/signal_matrix.py (the whole matrix).

Moments ("phases"): `loading` (the scheduler process exists, not ready), `compiling` (the first
"compiling the decode step" line of a cold start), `warm` (the same line on a start whose compile
cache is full), `idle` (ready, nothing running), `load` (streams running), `draining` (streams
running, a SIGTERM sent first: the signal is the second one). Servers run with
`--shutdown-timeout 5`: a drain lets requests finish for 5 s, then ends the rest with an error.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from batonlm.bench.server_process import free_port
from batonlm.process_tree import descendants

PHASES = ("loading", "compiling", "warm", "idle", "load", "draining")
SETUPS = {"1 rank": (), "--tp 2": ("--tp", "2"), "--dp 2": ("--dp", "2")}
# How long the server's processes get to be gone after it exits.
LEFT_AFTER_S = 10.0
# A phase's start-up waits at most this long for its moment.
MOMENT_TIMEOUT_S = 300.0


@dataclass
class Outcome:
    phase: str
    signal: str
    setup: str
    exit_code: int | None  # None: it did not exit within the wait
    exit_s: float
    left: list[int]  # its processes still alive afterwards
    streams: list[str] = field(default_factory=list)  # how each stream in flight ended: "done", "error", ...
    log: str = ""

    @property
    def traceback(self) -> bool:
        """A traceback, or a resource left behind (multiprocessing's resource tracker warns of
        leaked semaphores or shared memory as the last process exits): nothing a user should see."""
        return "Traceback" in self.log or "resource_tracker: There appear to be" in self.log


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _stream(url: str, results: list[str], started: threading.Event) -> None:
    """A long completion stream: "done" ([DONE] after its tokens), "error" (an error event), or
    how the connection ended; `started` is set by its first event (the server took it)."""
    body = {"prompt": "Once", "max_tokens": 480, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            if r.status_code != 200:
                results.append(f"status {r.status_code}")
                return
            last = ""
            for line in r.iter_lines():
                if line.startswith("data: "):
                    started.set()
                    if '"error"' in line:
                        results.append("error")
                        return
                    last = line
            results.append("done" if last == "data: [DONE]" else "cut")
    except httpx.HTTPError as e:
        results.append(type(e).__name__)


def probe(phase: str, sig: signal.Signals, setup: tuple[str, ...] = (), *, setup_name: str = "1 rank",
          compile_cache: str | None = None, exit_wait_s: float = 30.0) -> Outcome:
    """Start a server, send `sig` to its main process at `phase`, and watch it end."""
    if phase not in PHASES:
        raise ValueError(f"unknown phase {phase!r}")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_file = tempfile.NamedTemporaryFile("w+", prefix=f"batonlm-signal-{phase}-", suffix=".log", delete=False)
    args = [sys.executable, "-m", "batonlm", "serve", "--port", str(port), *setup]
    if phase in ("compiling", "warm"):
        # One decode bucket keeps the cold compile short; the cache is the caller's (warm: filled).
        args += ["--compile", "on", "--max-running-requests", "1",
                 "--compile-cache-dir", compile_cache or tempfile.mkdtemp(prefix="batonlm-cc-")]
    else:
        # A drain lets requests finish for 5 s, then ends the rest with an error.
        args += ["--compile", "off", "--max-running-requests", "2", "--shutdown-timeout", "5"]
    proc = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"})
    seen: set[int] = set()
    streams: list[str] = []
    threads: list[threading.Thread] = []

    def log() -> str:
        return Path(log_file.name).read_text()

    deadline = time.monotonic() + MOMENT_TIMEOUT_S
    while True:  # wait for the moment
        seen.update(descendants(proc.pid))
        text = log()
        if phase == "loading" and any(_alive(p) for p in seen) and "ready on" not in text:
            break
        if phase in ("compiling", "warm") and "compiling the decode step" in text:
            break
        if phase in ("idle", "load", "draining") and "ready on" in text:
            break
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the server never reached {phase!r}:\n{text}")
        time.sleep(0.02)
    if phase in ("load", "draining"):
        started = [threading.Event() for _ in range(4)]
        threads = [threading.Thread(target=_stream, args=(url, streams, e), daemon=True) for e in started]
        for t in threads:
            t.start()
        # Every stream taken (its first event), none still connecting. Counting them in the
        # server instead missed streams that had already ended when the server was fast.
        while not all(e.is_set() for e in started):
            if time.monotonic() > deadline or not all(t.is_alive() or e.is_set() for t, e in zip(threads, started)):
                proc.kill()
                raise RuntimeError(f"the streams never all reached the server (they ended: {streams}):\n{log()}")
            time.sleep(0.05)
    if phase == "draining":
        proc.send_signal(signal.SIGTERM)
        while "shutting down" not in log():
            time.sleep(0.02)
    seen.update(descendants(proc.pid))
    t0 = time.monotonic()
    proc.send_signal(sig)
    try:
        code: int | None = proc.wait(exit_wait_s)
    except subprocess.TimeoutExpired:
        code = None
        proc.kill()
        proc.wait()
    exit_s = time.monotonic() - t0
    for t in threads:
        t.join(30)
    # Children end after their parent: killed with it (PDEATHSIG), or, as multiprocessing's
    # resource tracker, when the pipes they read close (a second or more under load). Left means
    # still there after LEFT_AFTER_S.
    deadline = time.monotonic() + LEFT_AFTER_S
    while any(_alive(p) for p in seen) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = sorted(p for p in seen if _alive(p))
    for p in left:  # leave nothing behind, whatever happened
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    text = log()
    os.unlink(log_file.name)
    return Outcome(phase, sig.name, setup_name, code, exit_s, left, sorted(streams), text)


def fill_compile_cache(cache_dir: str) -> None:
    """A cold start with compiling on (one bucket) to the ready line, so that `warm` finds it full."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "batonlm", "serve", "--port", str(port), "--compile", "on", "--max-running-requests",
         "1", "--compile-cache-dir", cache_dir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "HF_HUB_OFFLINE": "1"})
    deadline = time.monotonic() + MOMENT_TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise RuntimeError("the compiling start failed")
            time.sleep(0.2)
        raise RuntimeError("the compiling start took too long")
    finally:
        proc.terminate()
        proc.wait(60)


def as_row(o: Outcome) -> dict:
    return {"setup": o.setup, "phase": o.phase, "signal": o.signal, "exit_code": o.exit_code,
            "exit_s": round(o.exit_s, 2), "left": len(o.left), "streams": o.streams, "traceback": o.traceback}


if __name__ == "__main__":  # one probe: python -m batonlm.bench.signal_probe PHASE SIGNAL [serve args]
    outcome = probe(sys.argv[1], signal.Signals[sys.argv[2]], tuple(sys.argv[3:]))
    print(json.dumps(as_row(outcome)))
