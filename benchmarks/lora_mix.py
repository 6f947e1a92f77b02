"""The cost of mixing LoRA adapters in a batch: decode throughput of 16 streams on the base
model alone, and spread over 1, 4 and 8 adapters (round robin), on one scheduler holding all
the adapters (the engine in process, its device as the server's; no HTTP).

Adapters: `--adapters DIR ...` (PEFT directories for MODEL), or random rank-`--rank` ones made
with peft over q/k/v/o/gate/up/down. Reported per mix, median of `--rounds` alternating rounds:
output tokens/s, its ratio to the base model's on the same engine and to the engine with LoRA off
(alternating rounds), and the device's time per iteration.

    python benchmarks/lora_mix.py [--model DIR] [--streams 16] [--adapters-in-use 0 1 4 8]
        [--device cuda --dtype bfloat16] [--output-json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from batonlm.config import EMBEDDED_MODEL, ServerArgs
from batonlm.ipc.messages import GenerateRequest
from batonlm.sampling_params import SamplingParams
from batonlm.scheduler.local_io import LocalIO
from batonlm.scheduler.process import build_scheduler

RESULTS = Path(__file__).resolve().parent / "results"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model: str, n: int, rank: int, root: Path) -> list[str]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = []
    for i in range(n):
        torch.manual_seed(i)
        base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
        get_peft_model(base, cfg).save_pretrained(str(root / f"a{i}"))
        paths.append(str(root / f"a{i}"))
    return paths


def run_once(sched, io: LocalIO, prompts: list[list[int]], streams: int, in_use: int, new_tokens: int) -> dict:
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i in range(streams):
        slot = (i % in_use) + 1 if in_use else 0
        io.submit(GenerateRequest(f"r{i}", prompts[i % len(prompts)], params, lora_key=slot), sched.iteration)
    before, compute_before = sched.timing.as_dict(), getattr(sched.device, "compute_s", 0.0)
    t0 = time.perf_counter()
    sched.event_loop_overlap()
    wall = time.perf_counter() - t0
    batches = sched.timing.as_dict()["batches"] - before["batches"]
    assert all(len(r.token_ids) == new_tokens for r in io.records.values())
    io.records.clear()
    return {"tokens_per_s": streams * new_tokens / wall, "wall_s": wall,
            "device_per_iter_ms": 1e3 * (getattr(sched.device, "compute_s", 0.0) - compute_before) / max(1, batches)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=EMBEDDED_MODEL)
    ap.add_argument("--adapters", nargs="*", default=None, help="PEFT adapter directories (default: random ones)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--adapters-in-use", type=int, nargs="+", default=[0, 1, 4, 8])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--compile", default="auto", choices=("auto", "on", "off"),
                    help="the CPU decode step (compiled: adapters' deltas inside the graph, RowSlotLoRA)")
    ap.add_argument("--output-json", default=str(RESULTS / "local" / "lora_mix.json"))
    args = ap.parse_args()

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    prompts = [tok(p).input_ids for p in ("Once upon a time", "Lily and Tom went to the park.", "The little dog")]
    with tempfile.TemporaryDirectory() as tmp:
        needed = max(args.adapters_in_use)
        paths = args.adapters or make_adapters(args.model, needed, args.rank, Path(tmp))
        assert len(paths) >= needed, f"{needed} adapters in use, {len(paths)} given"
        io = LocalIO(encode=True)
        server_args = ServerArgs(model=args.model, max_running_requests=args.streams, device=args.device,
                                 dtype=args.dtype, max_lora_rank=max(64, args.rank), compile=args.compile,
                                 lora_paths=",".join(f"a{i}={p}" for i, p in enumerate(paths)))
        sched, info = build_scheduler(server_args, io)
        io.bind(lambda: sched.iteration)
        # The same engine with LoRA off: what serving adapters costs the base model's requests.
        plain_io = LocalIO(encode=True)
        plain, _ = build_scheduler(ServerArgs(model=args.model, max_running_requests=args.streams, device=args.device,
                                              dtype=args.dtype, compile=args.compile), plain_io)
        plain_io.bind(lambda: plain.iteration)
        runs: dict[int, list[dict]] = {k: [] for k in args.adapters_in_use}
        plain_runs: list[dict] = []
        try:
            run_once(sched, io, prompts, args.streams, needed, 16)  # warm-up: every adapter once
            run_once(plain, plain_io, prompts, args.streams, 0, 16)
            for _ in range(args.rounds):  # alternating: the machine's drift hits every mix alike
                plain_runs.append(run_once(plain, plain_io, prompts, args.streams, 0, args.new_tokens))
                for k in args.adapters_in_use:
                    runs[k].append(run_once(sched, io, prompts, args.streams, k, args.new_tokens))
        finally:
            sched.device.close()
            plain.device.close()
    rows = []
    base = statistics.median(r["tokens_per_s"] for r in runs[args.adapters_in_use[0]])
    plain_tps = statistics.median(r["tokens_per_s"] for r in plain_runs)
    for k, rs in [("LoRA off", plain_runs), *runs.items()]:
        tps = statistics.median(r["tokens_per_s"] for r in rs)
        rows.append({"adapters_in_use": k, "tokens_per_s": tps, "ratio_to_first": tps / base,
                     "ratio_to_lora_off": tps / plain_tps,
                     "device_per_iter_ms": statistics.median(r["device_per_iter_ms"] for r in rs)})
    print(f"\nbatonlm LoRA mix: {Path(args.model).name} on {info.device} ({info.dtype}), {args.streams} streams, "
          f"{args.new_tokens} new tokens each, adapters of rank {args.rank if not args.adapters else 'given'}, "
          f"decode step compile {args.compile}, median of {args.rounds} rounds, {os.cpu_count()} CPUs\n")
    print(f"{'adapters in use':>15} | {'output tokens/s':>15} | {'vs ' + str(args.adapters_in_use[0]):>6} | "
          f"{'vs off':>6} | {'device ms/iter':>14}")
    print("-" * 69)
    for r in rows:
        print(f"{r['adapters_in_use']:>15} | {r['tokens_per_s']:>15.0f} | {r['ratio_to_first']:>6.2f} | "
              f"{r['ratio_to_lora_off']:>6.2f} | {r['device_per_iter_ms']:>14.3f}")
    print("\nLoRA off: the same engine without adapters. 0 adapters: every stream on the base model, the adapters "
          "loaded, none used (a compiled step still runs the slots' matmuls, with zero deltas).")
    out = Path(args.output_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": args.model, "device": info.device, "dtype": info.dtype, "compile": args.compile,
                               "streams": args.streams, "new_tokens": args.new_tokens, "rounds": args.rounds,
                               "cpus": os.cpu_count(), "machine": platform.machine(), "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
