"""Constrained decoding under both loops: what grammar masks cost, and whether the overlap loop
keeps its gain when every batch samples late.

For each workload — free (no constraint) and constrained (every request a JSON schema) — N
requests at once (greedy, `--new-tokens` tokens at most; constrained ones may end earlier when
their JSON closes) run on one scheduler and its CPU device worker, alternating the normal and
the overlap loop, median of `--rounds`. Reported: output tokens/s of each loop and the overlap
gain (overlap / normal - 1) per workload; and the scheduler's mask cost per constrained token
(filling the bitmask rows with xgrammar, timed around `GrammarQueue.masks`).

    python benchmarks/constrained.py [--concurrency 1 16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from batonlm.config import EMBEDDED_MODEL, ServerArgs
from batonlm.ipc.messages import GenerateRequest
from batonlm.sampling_params import SamplingParams
from batonlm.scheduler.local_io import LocalIO
from batonlm.scheduler.process import build_scheduler

RESULTS = Path(__file__).resolve().parent / "results"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
            "kind": {"enum": ["cat", "dog", "bird"]}, "name": {"type": "string", "maxLength": 12}},
            "required": ["kind", "name"]}},
    },
    "required": ["name", "age", "pets"],
}
PROMPTS = [[1, 403, 407, 261, 378], [1, 300, 301], [1, 500, 421], [1, 261]]


def run_once(sched, io: LocalIO, n: int, new_tokens: int, constrained: bool, overlap: bool) -> dict:
    extra = {"json_schema": json.dumps(SCHEMA)} if constrained else {"ignore_eos": True}
    for i in range(n):
        params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, **extra)
        io.submit(GenerateRequest(f"r{i}", PROMPTS[i % len(PROMPTS)], params), sched.iteration)
    t0 = time.perf_counter()
    (sched.event_loop_overlap if overlap else sched.event_loop_normal)()
    wall = time.perf_counter() - t0
    tokens = sum(len(r.token_ids) for r in io.records.values())
    io.records.clear()
    return {"tokens_per_s": tokens / wall, "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=EMBEDDED_MODEL)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--output-json", default=str(RESULTS / "local" / "constrained.json"))
    args = ap.parse_args()

    io = LocalIO(encode=True)
    sched, _ = build_scheduler(ServerArgs(model=args.model, max_running_requests=max(args.concurrency), compile="off"), io)
    io.bind(lambda: sched.iteration)
    grammars = sched.grammars
    mask_time = {"s": 0.0, "rows": 0}
    masks = grammars.masks

    def timed_masks(batch):
        t0 = time.perf_counter()
        out = masks(batch)
        mask_time["s"] += time.perf_counter() - t0
        mask_time["rows"] += len(out.get("mask_rows", []))
        return out

    grammars.masks = timed_masks
    try:
        run_once(sched, io, 2, 16, True, True)  # warm-up (and the grammar's compile)
        run_once(sched, io, 2, 16, False, True)
        mask_time.update(s=0.0, rows=0)
        rows = []
        for c in args.concurrency:
            row = {"concurrency": c}
            for constrained in (False, True):
                runs = {False: [], True: []}
                for _ in range(args.rounds):
                    for overlap in (False, True):
                        runs[overlap].append(run_once(sched, io, c, args.new_tokens, constrained, overlap))
                normal = statistics.median(r["tokens_per_s"] for r in runs[False])
                over = statistics.median(r["tokens_per_s"] for r in runs[True])
                row["constrained" if constrained else "free"] = {"normal": normal, "overlap": over,
                                                                 "gain": over / normal - 1}
            rows.append(row)
    finally:
        sched.device.close()
    per_token_us = 1e6 * mask_time["s"] / max(1, mask_time["rows"])

    print(f"\nstories260K, greedy, {args.new_tokens} tokens at most, median of {args.rounds} rounds; "
          f"{os.cpu_count()} CPUs\n")
    head = (f"{'conc':>4} | {'free tok/s n / o':>18} | {'free gain':>9} | {'constrained tok/s n / o':>23} | "
            f"{'constrained gain':>16}")
    print(head)
    print("-" * len(head))
    for r in rows:
        f, k = r["free"], r["constrained"]
        print(f"{r['concurrency']:>4} | {f['normal']:>8.0f} / {f['overlap']:<7.0f} | {100 * f['gain']:>8.1f}% | "
              f"{k['normal']:>11.0f} / {k['overlap']:<9.0f} | {100 * k['gain']:>15.1f}%")
    print(f"\nmask cost in the scheduler: {per_token_us:.1f} us per constrained token ({mask_time['rows']} masks)")
    out = Path(args.output_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "constrained", "rows": rows, "mask_us_per_token": per_token_us,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "command": "python benchmarks/constrained.py " + " ".join(sys.argv[1:]),
    }, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
