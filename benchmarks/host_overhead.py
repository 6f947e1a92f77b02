"""The host side's ceiling: what the frontend and scheduler cost per streamed token when the
device costs nothing (`--device null`), and how idle they leave a device whose step takes a
modelled 3.4 ms (a Llama-3-8B bfloat16 decode step on an H200).

A closed-loop client (raw asyncio HTTP/1.1, keep-alive, SSE read as bytes: the cheapest client
Python has) keeps C streams busy for --duration seconds, each request `max_tokens` long with EOS
ignored; tokens are counted from each stream's final usage chunk. CPU time per process comes
from /proc: the main process (HTTP, tokenizer manager, detokenization, SSE) and the scheduler
(planning, KV accounting, results, and the null device's relay); the scheduler's iterations and
the modelled device's busy time from /metrics. Reported per scenario:

    tok/s           streamed output tokens per second (all streams, the whole run)
    main us/tok     main-process CPU per streamed token
    sched us/iter   scheduler CPU per iteration;   sched us/tok: per token (a running request's row)
    sched busy      scheduler CPU / wall (1.0: the loop never waits)
    client us/tok   this benchmark's own CPU per token (it shares the machine's cores)
    iter ms         wall time per scheduler iteration (on a real device: the step the host must hide under)
    device idle     1 - modelled device busy / wall (with --null-step-ms; the overlap loop's aim: 0)

    python benchmarks/host_overhead.py [--streams 1 64 256 1024] [--duration 8] [--json out.json]
    python benchmarks/host_overhead.py --quick          # fewer scenarios, shorter runs
    python benchmarks/host_overhead.py --only regex --streams 256 --step-ms 0   # one scenario
    python benchmarks/host_overhead.py --device cuda --model DIR   # the same figures on a real device
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from batonlm.bench.server_process import ServerProcess

RESULTS = Path(__file__).resolve().parent / "results"
TICK = os.sysconf("SC_CLK_TCK")
GAUGES = ("batonlm_scheduler_batches", "batonlm_device_compute_seconds", "batonlm_scheduler_cpu_seconds")
PROMPT = ("You are a helpful assistant. Answer briefly and stay on the topic the user asks about. "
          "Story {i}: once upon a time there was a little cat who liked to play in the garden.")
USAGE = re.compile(rb'"completion_tokens":\s*(\d+)')


@dataclass(frozen=True)
class Scenario:
    name: str
    route: str = "chat"  # chat | completions
    n: int = 1
    stop: bool = False
    logprobs: bool = False
    constrained: bool = False
    streams: int = 256

    def body(self, i: int, model: str, max_tokens: int) -> bytes:
        req: dict = {"model": model, "max_tokens": max_tokens, "stream": True, "ignore_eos": True, "n": self.n,
                     "stream_options": {"include_usage": True}, "temperature": 0.0}
        text = PROMPT.format(i=i)
        if self.route == "chat":
            req["messages"] = [{"role": "user", "content": text}]
        else:
            req["prompt"] = text
        if self.stop:
            req["stop"] = ["<|im_end|>", "\n\n\n\n"]
        if self.logprobs:
            req.update({"logprobs": True, "top_logprobs": 5} if self.route == "chat" else {"logprobs": 5})
        if self.constrained:
            req["regex"] = "([a-z]+ )*"
        return json.dumps(req).encode()


def scenarios(streams: list[int], quick: bool) -> list[Scenario]:
    out = [Scenario(f"chat {c}", streams=c) for c in streams]
    at = 256 if 256 in streams else max(streams)
    out += [Scenario(f"completions {at}", route="completions", streams=at),
            Scenario(f"chat n=4 {at // 4}x4", n=4, streams=at // 4)]
    if not quick:
        out += [Scenario(f"chat stop {at}", stop=True, streams=at),
                Scenario(f"chat logprobs {at}", logprobs=True, streams=at),
                Scenario(f"chat regex {at}", constrained=True, streams=at),
                Scenario(f"completions n=4 {at // 4}x4", route="completions", n=4, streams=at // 4)]
    return out


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def scrape(base_url: str) -> dict[str, float]:
    text = httpx.get(base_url + "/metrics", timeout=30).text
    out = {}
    for name in GAUGES:
        m = re.search(rf"^{name}{{[^}}]*}} ([0-9.e+-]+)$", text, re.M)
        out[name] = float(m.group(1)) if m else 0.0
    return out


@dataclass
class Load:
    tokens: int = 0
    requests: int = 0
    errors: list[str] = field(default_factory=list)


async def stream(port: int, path: str, bodies, deadline: float, load: Load) -> None:
    """One client stream: requests back to back on one keep-alive connection until the deadline."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for body in bodies:
            if time.perf_counter() >= deadline:
                return
            writer.write(b"POST %s HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (path.encode(), len(body), body))
            buf = bytearray()
            while not buf.endswith(b"\r\n0\r\n\r\n"):
                chunk = await reader.read(65536)
                if not chunk:
                    load.errors.append("connection closed")
                    return
                buf += chunk
                if not buf.startswith(b"HTTP/1.1 200"):
                    load.errors.append(bytes(buf[:300]).decode(errors="replace"))
                    return
            found = USAGE.findall(buf)
            if not found:
                load.errors.append("no usage chunk")
                return
            load.tokens += int(found[-1])
            load.requests += 1
    finally:
        writer.close()


def run_load(port: int, sc: Scenario, model: str, max_tokens: int, duration: float) -> tuple[Load, float]:
    path = "/v1/chat/completions" if sc.route == "chat" else "/v1/completions"
    load = Load()

    async def main() -> float:
        t0 = time.perf_counter()
        deadline = t0 + duration

        def bodies(s: int):
            k = 0
            while True:
                yield sc.body(s * 100_000 + k, model, max_tokens)
                k += 1

        await asyncio.gather(*(stream(port, path, bodies(s), deadline, load) for s in range(sc.streams)))
        return time.perf_counter() - t0

    return load, asyncio.run(main())


def measure(server: ServerProcess, sc: Scenario, model: str, max_tokens: int, duration: float) -> dict:
    procs = {"main": [server.proc.pid], "sched": server.descendants()}
    before = {k: sum(cpu_s(p) for p in v) for k, v in procs.items()}
    self0 = resource.getrusage(resource.RUSAGE_SELF)
    m0 = scrape(server.base_url)
    load, wall = run_load(server.port, sc, model, max_tokens, duration)
    m1 = scrape(server.base_url)
    self1 = resource.getrusage(resource.RUSAGE_SELF)
    after = {k: sum(cpu_s(p) for p in v) for k, v in procs.items()}
    if load.errors:
        raise RuntimeError(f"{sc.name}: {len(load.errors)} failed, e.g. {load.errors[0]}")
    tok = max(1, load.tokens)
    iters = max(1.0, m1["batonlm_scheduler_batches"] - m0["batonlm_scheduler_batches"])
    main, sched = after["main"] - before["main"], after["sched"] - before["sched"]
    client = (self1.ru_utime + self1.ru_stime) - (self0.ru_utime + self0.ru_stime)
    busy = m1["batonlm_device_compute_seconds"] - m0["batonlm_device_compute_seconds"]
    return {
        "scenario": sc.name, "streams": sc.streams, "n": sc.n, "tokens": load.tokens, "requests": load.requests,
        "wall_s": round(wall, 2), "tok_s": round(load.tokens / wall),
        "main_us_per_tok": round(main / tok * 1e6, 1),
        "sched_us_per_iter": round(sched / iters * 1e6, 1), "sched_us_per_tok": round(sched / tok * 1e6, 1),
        "tok_per_iter": round(load.tokens / iters, 1), "iter_ms": round(wall / iters * 1e3, 3),
        "sched_busy": round(sched / wall, 2),
        "main_busy": round(main / wall, 2), "client_us_per_tok": round(client / tok * 1e6, 1),
        "device_idle": round(1 - busy / wall, 3) if busy else None,
    }


COLUMNS = [("scenario", "scenario", 26), ("step ms", "step_ms", 7), ("tok/s", "tok_s", 8),
           ("main us/tok", "main_us_per_tok", 11), ("sched us/iter", "sched_us_per_iter", 13),
           ("sched us/tok", "sched_us_per_tok", 12), ("tok/iter", "tok_per_iter", 8), ("iter ms", "iter_ms", 7),
           ("sched busy", "sched_busy", 10),
           ("main busy", "main_busy", 9), ("client us/tok", "client_us_per_tok", 13), ("device idle", "device_idle", 11)]


def table(rows: list[dict]) -> str:
    head = " | ".join(h.rjust(w) for h, _, w in COLUMNS)
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(" | ".join(("-" if r.get(k) is None else str(r[k])).rjust(w) for _, k, w in COLUMNS))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded model")
    ap.add_argument("--device", default="null")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 64, 256, 1024])
    ap.add_argument("--step-ms", type=float, nargs="+", default=[0.0, 3.4],
                    help="--null-step-ms values; scenarios run at the first, the concurrency sweep at each")
    ap.add_argument("--max-tokens", type=int, default=256, help="each request's output tokens (EOS ignored)")
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--quick", action="store_true", help="chat, completions and n=4 only, 4 s runs")
    ap.add_argument("--only", default=None, help="run only the scenarios whose name contains this (e.g. regex)")
    ap.add_argument("--server-arg", action="append", default=[], help="an extra `batonlm serve` argument")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    duration = 4.0 if args.quick else args.duration
    model_flags = ["--model", args.model] if args.model else []
    extra = [a for s in args.server_arg for a in s.split()]
    rows: list[dict] = []
    steps = args.step_ms if args.device == "null" else [None]
    for k, step in enumerate(steps):
        flags = [*model_flags, "--device", args.device, "--max-running-requests", str(max(1024, max(args.streams))),
                 "--max-total-tokens", "400000", "--max-queued-requests", "4096", *extra]
        if step is not None:
            flags += ["--null-step-ms", str(step)]
        server = ServerProcess(*flags, startup_timeout=600)
        try:
            model = httpx.get(server.base_url + "/v1/models").json()["data"][0]["id"]
            run_load(server.port, Scenario("warm-up", streams=8), model, 8, 0.5)  # first requests: imports, caches
            todo = scenarios(args.streams, args.quick) if k == 0 else [Scenario(f"chat {c}", streams=c)
                                                                         for c in args.streams if c > 1]
            todo = [sc for sc in todo if args.only is None or args.only in sc.name]
            for sc in todo:
                row = measure(server, sc, model, args.max_tokens, duration)
                row["step_ms"] = step if step is not None else "real"
                rows.append(row)
                print(table([row]).splitlines()[-1] if rows[:-1] else table([row]), flush=True)
        finally:
            server.stop()
    print()
    print(table(rows))
    out = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0]},
           "device": args.device, "max_tokens": args.max_tokens, "duration_s": duration, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
