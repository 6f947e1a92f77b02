"""A bounded soak of `batonlm serve`: streams, aborts, slow readers, bad inputs and disconnects,
and the hostile-client probe's mix (constraints — JSON schemas, regexes, forced tool calls —,
logprobs with constraints, prompt logprobs with echo), all at once, for a few minutes; then
checks that nothing broke and nothing leaked.

Reports: requests by kind and status (the aim: 0 5xx, every good stream ends in [DONE], every
bad input gets its 4xx), KV and request slots back to 0 after the load, the main process's RSS
and open file descriptors over time (the aim: flat after warm-up), and /health's latency
(polled every second; the aim: max < 1 s).

    python benchmarks/soak.py [--duration 180] [--concurrency 24] [--output-json PATH]
                              [--server-args --dp 2 ...]

Not part of CI (it runs for minutes); docs/reliability.md has the latest numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from bad_inputs import CORPUS  # noqa: E402
from live_helpers import open_fds, rss_bytes  # noqa: E402

from batonlm.bench.server_process import ServerProcess  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
PROMPTS = ["Once upon a time", "Lily and Tom went to the park.", "The little dog", "One day, a bird"]


class Soak:
    def __init__(self, url: str, seed: int) -> None:
        self.url = url
        self.rng = random.Random(seed)
        self.outcomes: Counter = Counter()  # (kind, outcome) -> count
        self.server_errors: list[str] = []

    def note(self, kind: str, outcome: str, detail: str = "") -> None:
        self.outcomes[(kind, outcome)] += 1
        if outcome.startswith("5") or outcome in ("broken_stream", "wrong_status"):
            self.server_errors.append(f"{kind} {outcome} {detail[:300]}")

    def _body(self, stream: bool) -> dict:
        return {"model": "stories260K", "messages": [{"role": "user", "content": self.rng.choice(PROMPTS)}],
                "max_tokens": self.rng.randint(8, 200), "temperature": self.rng.choice([0.0, 0.8]),
                "stream": stream}

    async def full_stream(self, c: httpx.AsyncClient) -> None:
        async with c.stream("POST", self.url + "/v1/chat/completions", json=self._body(True)) as r:
            if r.status_code != 200:
                return self.note("stream", str(r.status_code), await r.aread())
            last = ""
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    last = line
                    if '"error"' in line:
                        return self.note("stream", "broken_stream", line)
            self.note("stream", "ok" if last == "data: [DONE]" else "broken_stream", last)

    async def aborted_stream(self, c: httpx.AsyncClient) -> None:
        async with c.stream("POST", self.url + "/v1/completions", json={
                "prompt": self.rng.choice(PROMPTS), "max_tokens": 400, "ignore_eos": True, "stream": True}) as r:
            if r.status_code != 200:
                return self.note("abort", str(r.status_code), await r.aread())
            n = self.rng.randint(1, 30)
            async for line in r.aiter_lines():
                n -= line.startswith("data: ")
                if n <= 0:
                    break
        self.note("abort", "ok")

    async def non_streamed(self, c: httpx.AsyncClient) -> None:
        r = await c.post(self.url + "/v1/chat/completions", json=self._body(False))
        self.note("complete", "ok" if r.status_code == 200 else str(r.status_code), r.text)

    async def disconnect(self, c: httpx.AsyncClient) -> None:
        try:
            await c.post(self.url + "/generate", json={"text": self.rng.choice(PROMPTS), "sampling_params": {
                "max_new_tokens": 400, "ignore_eos": True}}, timeout=self.rng.uniform(0.01, 0.3))
            self.note("disconnect", "finished_first")
        except httpx.TimeoutException:
            self.note("disconnect", "ok")

    async def constrained(self, c: httpx.AsyncClient) -> None:
        """The probe's constrained mix: a JSON schema, a regex with logprobs, forced tool calls."""
        kind = self.rng.choice(["schema", "regex", "tools"])
        if kind == "schema":
            schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                       "age": {"type": "integer"}}, "required": ["name", "age"]}
            body = {"messages": [{"role": "user", "content": self.rng.choice(PROMPTS)}], "max_tokens": 60,
                    "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
                    "logprobs": True, "top_logprobs": 3}
            path = "/v1/chat/completions"
        elif kind == "regex":
            body = {"prompt": self.rng.choice(PROMPTS), "max_tokens": 8, "regex": "(yes|no|maybe)", "logprobs": 5}
            path = "/v1/completions"
        else:
            tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
                "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}}}
            body = {"messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 60, "tools": [tool],
                    "tool_choice": "required"}
            path = "/v1/chat/completions"
        stream = self.rng.random() < 0.5
        if stream:
            async with c.stream("POST", self.url + path, json={**body, "stream": True}) as r:
                text = (await r.aread()).decode()
            ok = r.status_code == 200 and text.rstrip().endswith("data: [DONE]") and '"error"' not in text
            return self.note(f"constrained_{kind}", "ok" if ok else ("broken_stream" if r.status_code == 200 else
                                                                      str(r.status_code)), text[-300:])
        r = await c.post(self.url + path, json=body)
        self.note(f"constrained_{kind}", "ok" if r.status_code == 200 else str(r.status_code), r.text)

    async def prompt_logprobs(self, c: httpx.AsyncClient) -> None:
        body = {"prompt": self.rng.choice(PROMPTS), "max_tokens": self.rng.randint(1, 16), "echo": True,
                "logprobs": self.rng.choice([0, 5, 20]), "n": self.rng.choice([1, 4])}
        r = await c.post(self.url + "/v1/completions", json=body)
        self.note("prompt_logprobs", "ok" if r.status_code == 200 else str(r.status_code), r.text)

    async def bad_input(self, c: httpx.AsyncClient) -> None:
        path, body, status, _, _ = self.rng.choice(CORPUS)
        if isinstance(body, bytes):
            r = await c.post(self.url + path, content=body, headers={"content-type": "application/json"})
        else:
            r = await c.post(self.url + path, json=body)
        self.note("bad_input", "ok" if r.status_code == status else "wrong_status", f"{path} {r.status_code} {r.text}")

    async def slow_reader(self, _: httpx.AsyncClient) -> None:
        host, port = self.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        body = json.dumps({"prompt": "Once", "max_tokens": 300, "ignore_eos": True, "stream": True, "n": 4}).encode()
        writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        await writer.drain()
        try:
            for _ in range(self.rng.randint(5, 40)):  # a trickle of reads, then hang up
                await asyncio.sleep(0.1)
                if not await reader.read(512):
                    break
            self.note("slow_reader", "ok")
        finally:
            writer.close()

    async def worker(self, c: httpx.AsyncClient, until: float) -> None:
        kinds = [self.full_stream] * 4 + [self.non_streamed] * 2 + [self.aborted_stream] * 2 + [
            self.disconnect, self.bad_input, self.bad_input, self.slow_reader] + [self.constrained] * 2 + [
            self.prompt_logprobs]
        while time.monotonic() < until:
            fn = self.rng.choice(kinds)
            try:
                await fn(c)
            except (httpx.TransportError, ConnectionError) as e:
                self.note(fn.__name__, "transport_error", repr(e))


async def sample(url: str, pid: int, until: float, t0: float, samples: list[dict]) -> None:
    async with httpx.AsyncClient(timeout=30) as c:
        while time.monotonic() < until:
            t = time.monotonic()
            health = await c.get(url + "/health")
            samples.append({"t": round(time.monotonic() - t0, 1), "rss_mb": rss_bytes(pid) / 2**20,
                            "fds": open_fds(pid), "health": health.status_code,
                            "health_s": round(time.monotonic() - t, 4)})
            await asyncio.sleep(1)


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def run(url: str, pid: int, duration: float, concurrency: int, seed: int) -> dict:
    soak = Soak(url, seed)
    t0 = time.monotonic()
    until = t0 + duration
    samples: list[dict] = []
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=120, limits=limits) as c:
        await asyncio.gather(sample(url, pid, until, t0, samples), *(soak.worker(c, until) for _ in range(concurrency)))
    # Idle again: every slot must come back.
    deadline = time.monotonic() + 60
    while True:
        text = httpx.get(url + "/metrics", timeout=30).text
        kv, req_slots = _metric(text, "batonlm_kv_cache_used_slots"), _metric(text, "batonlm_request_slots_used")
        if (kv == 0 and req_slots == 0) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    warm = [s for s in samples if s["t"] >= duration * 0.25]
    return {
        "duration_s": duration,
        "concurrency": concurrency,
        "requests": sum(soak.outcomes.values()),
        "outcomes": {f"{k} {o}": n for (k, o), n in sorted(soak.outcomes.items())},
        "server_errors": soak.server_errors[:20],
        "num_server_errors": len(soak.server_errors),
        "kv_used_after": kv,
        "req_slots_used_after": req_slots,
        "rss_mb_after_warmup": [round(warm[0]["rss_mb"], 1), round(max(s["rss_mb"] for s in warm), 1),
                                round(warm[-1]["rss_mb"], 1)] if warm else None,
        "fds_after_warmup": [warm[0]["fds"], max(s["fds"] for s in warm), warm[-1]["fds"]] if warm else None,
        "health_failures": sum(1 for s in samples if s["health"] != 200),
        "health_max_s": max((s["health_s"] for s in samples), default=None),
        "samples": samples,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=180.0)
    ap.add_argument("--concurrency", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--server-args", nargs=argparse.REMAINDER, default=[], help="extra `batonlm serve` flags")
    ap.add_argument("--output-json", default=str(RESULTS / "local" / "soak.json"))
    args = ap.parse_args()
    server = ServerProcess(*args.server_args)
    try:
        result = asyncio.run(run(server.base_url, server.proc.pid, args.duration, args.concurrency, args.seed))
    finally:
        code = server.stop()
    result["server_exit_code"] = code
    result["machine"] = {"cpus": __import__("os").cpu_count(), "python": platform.python_version()}
    print(f"batonlm soak: {result['duration_s']:.0f} s, {result['concurrency']} clients, {result['requests']} requests")
    for k, n in result["outcomes"].items():
        print(f"  {k:32s} {n:7d}")
    print(f"server errors (5xx, broken streams, wrong statuses): {result['num_server_errors']}")
    for line in result["server_errors"]:
        print("   ", line)
    print(f"after the load: KV slots used {result['kv_used_after']:.0f}, request slots used "
          f"{result['req_slots_used_after']:.0f}; /health failures {result['health_failures']}, slowest "
          f"{result['health_max_s']} s")
    print(f"main process RSS MB after warm-up (first, max, last): {result['rss_mb_after_warmup']}")
    print(f"main process open fds after warm-up (first, max, last): {result['fds_after_warmup']}")
    print(f"server exit code: {code}")
    Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output_json).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.output_json}")
    ok = result["num_server_errors"] == 0 and result["kv_used_after"] == 0 and code == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
