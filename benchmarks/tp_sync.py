"""Tensor parallelism on the CPU (gloo): what the per-iteration synchronisation costs, and the
decode throughput of 1, 2 and 4 ranks side by side.

Part 1, micro (ranks in spawned processes, `--ranks` of them, medians over `--reps`):
  * relay: rank 0 relays a decode launch of B rows (the real `BatchLaunch` bytes) to the others —
    what every iteration adds before the forward;
  * heartbeat: what an idle second costs (a broadcast and an all-reduce);
  * all-reduce of a [B, hidden] float32 activation (2 per layer + 1 per forward), all-gather of
    the [B, vocab / ranks] logits (1 per forward).
Part 2, end to end: greedy decode tokens/s of stories260K (or `--model`) on a scheduler with its
device at 1, 2, 4 ranks, `--concurrency` requests at once, outputs checked equal to one rank's.
Part 3, serving: `batonlm bench` (random 64 in / 64 out, `--serving-concurrency` at once) against
a server with one rank, `--tp 2`, `--dp 2`, and `--dp 2 --enable-dp-attention`.
On a CPU the ranks share the same cores: this measures the cost of the synchronisation, not a
speed-up (a model that needs more than one device is what TP is for, on GPUs).

It takes 10 to 15 minutes on 2 cores (parts 2 and 3 start a scheduler or a server per setup);
`--tp 1 2` and a smaller `--reps` shorten it.

    python benchmarks/tp_sync.py [--ranks 2] [--reps 200] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
HIDDEN = (64, 4096)
ROWS = (1, 16, 64)


def _decode_launch(rows: int) -> bytes:
    from batonlm.ipc import codec
    from batonlm.ipc.device_messages import BatchLaunch
    from batonlm.sampling_params import LogitChanges

    return codec.encode(BatchLaunch(
        batch_id=12345, req_slots=list(range(rows)), prefix_lens=[300 + i for i in range(rows)],
        extend_lens=[1] * rows, from_future=[True] * rows, input_ids=[], out_cache_loc=[4000 + i for i in range(rows)],
        new_slots=[], all_greedy=True, logit_changes=LogitChanges.NONE,
    ))


def _timed(fn, reps: int, barrier) -> float:
    """Median seconds of fn() over reps, each closed by a barrier so every rank finished it."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        barrier()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def micro_job(rank: int, size: int, addr: str, reps: int, device: str, out) -> None:
    import torch
    import torch.distributed as dist

    from batonlm.distributed.group import TPGroup
    from batonlm.distributed.relay import LaunchRelay

    torch.set_num_threads(1)
    dev = f"cuda:{rank}" if device == "cuda" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(dev)
    tp = TPGroup.init(rank, size, addr, 60.0, dev)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    relay = LaunchRelay(tp)
    def barrier() -> None:
        dist.barrier(group=tp.cpu_group)

    _timed(barrier, 20, lambda: None)  # warm the connections
    res = {}
    empty = _timed(lambda: None, reps, barrier)
    res["barrier"] = empty
    for rows in ROWS:
        data = _decode_launch(rows)
        fn = (lambda d=data: relay.send(d)) if rank == 0 else relay.recv
        res[f"relay B={rows} ({len(data)} B)"] = _timed(fn, reps, barrier) - empty
    res["heartbeat"] = _timed(relay.heartbeat if rank == 0 else relay.recv, reps, barrier) - empty
    row = torch.zeros(5, dtype=torch.int64)  # DP attention's sync row (dp_sync.py)
    res["DP sync row all-gather"] = _timed(lambda: tp.all_gather_cpu(row), reps, barrier) - empty
    for hidden in HIDDEN:
        for rows in ROWS:
            x = torch.randn(rows, hidden, device=dev)
            res[f"all-reduce [{rows}, {hidden}]"] = _timed(lambda x=x: (tp.all_reduce(x), sync()), reps, barrier) - empty
    for rows in ROWS:
        x = torch.randn(rows, 32000 // size, device=dev)
        res[f"all-gather [{rows}, 32000/{size}]"] = _timed(
            lambda x=x: (tp.all_gather_last_dim(x), sync()), reps, barrier) - empty
    if rank == 0:
        out.put(res)
    tp.destroy()


def micro(ranks: int, reps: int, device: str) -> dict[str, float]:
    from batonlm.device.spec import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    addr = f"127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=micro_job, args=(r, ranks, addr, reps, device, out)) for r in range(ranks)]
    for p in procs:
        p.start()
    res = out.get(timeout=600)
    for p in procs:
        p.join(30)
    return res


def decode_rate(model: str, tp: int, concurrency: int, new_tokens: int, rounds: int, compile: str,
                device: str) -> tuple[float, list]:
    from batonlm.config import ServerArgs
    from batonlm.ipc.messages import GenerateRequest
    from batonlm.sampling_params import SamplingParams
    from batonlm.scheduler.local_io import LocalIO
    from batonlm.scheduler.process import build_scheduler

    io = LocalIO()
    sched, _ = build_scheduler(ServerArgs(model=model, tp_size=tp, device=device,
                                             compile=compile if device == "cpu" else "auto"), io)
    io.bind(lambda: sched.iteration)
    rates, outputs = [], None
    try:
        for r in range(rounds + 1):  # the first round warms up
            for i in range(concurrency):
                params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
                io.submit(GenerateRequest(f"r{i}", [1, 400 + i, 30, 55 + i], params), sched.iteration)
            t0 = time.perf_counter()
            sched.event_loop_overlap()
            wall = time.perf_counter() - t0
            outputs = [io.records[f"r{i}"].token_ids for i in range(concurrency)]
            io.records.clear()
            if r:
                rates.append(concurrency * new_tokens / wall)
    finally:
        sched.device.close()
    return statistics.median(rates), outputs


SERVING = {"one rank": [], "--tp 2": ["--tp", "2"], "--dp 2": ["--dp", "2"],
           "--dp 2 --enable-dp-attention": ["--dp", "2", "--enable-dp-attention"]}


def serving(model: str, concurrency: int, prompts: int, device: str) -> list[dict]:
    import subprocess
    import sys
    import tempfile

    from batonlm.bench.server_process import ServerProcess

    rows = []
    for name, flags in SERVING.items():
        server = ServerProcess(model, "--device", device, *flags)
        try:
            with tempfile.TemporaryDirectory() as tmp:
                summary = None
                for n in (concurrency, prompts):  # a warm-up round, then the measured one
                    cmd = [sys.executable, "-m", "batonlm", "bench", "--base-url", server.base_url,
                           "--num-prompts", str(n), "--max-concurrency", str(concurrency), "--request-rate", "inf",
                           "--random-input-len", "64", "--random-output-len", "64", "--random-range-ratio", "1.0",
                           "--seed", "0", "--disable-progress-bar", "--output-json", f"{tmp}/out.json"]
                    subprocess.run(cmd, check=True, capture_output=True, timeout=1800)
                    summary = json.loads(Path(f"{tmp}/out.json").read_text())["summary"]
        finally:
            server.stop()
        assert summary["failed"] == 0, summary["errors"]
        rows.append({"server": name, "tokens_per_s": summary["output_throughput"],
                     "itl_median_ms": summary["itl_ms"]["median"], "ttft_median_ms": summary["ttft_ms"]["median"]})
        print(f"  {name:30s} {summary['output_throughput']:8.1f} tok/s  ITL median {summary['itl_ms']['median']:7.2f} ms"
              f"  TTFT median {summary['ttft_ms']['median']:7.1f} ms", flush=True)
    return rows


def main() -> None:
    from batonlm.config import EMBEDDED_MODEL

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=EMBEDDED_MODEL)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--serving-concurrency", type=int, default=16)
    ap.add_argument("--serving-prompts", type=int, default=64)
    ap.add_argument("--no-serving", action="store_true", help="skip part 3")
    ap.add_argument("--json", default=str(RESULTS / "local" / "tp_sync.json"))
    args = ap.parse_args()

    res = micro(args.ranks, args.reps, args.device)
    backend = "NCCL" if args.device == "cuda" else "gloo"
    print(f"per-operation cost over {args.ranks} {backend} ranks (median of {args.reps}):")
    for name, s in res.items():
        print(f"  {name:32s} {s * 1e6:9.1f} us")
    rows = []
    print(f"\ndecode tokens/s, {args.new_tokens} new tokens per request (median of {args.rounds}):")
    for c in args.concurrency:
        base, want = None, None
        # One rank eager first (ranks > 1 run the decode step eagerly), then compiled where it pays.
        one = [(1, "off"), (1, "auto")] if args.device == "cpu" else [(1, "auto")]
        for tp, compile in one + [(t, "off") for t in args.tp if t > 1]:
            rate, outputs = decode_rate(args.model, tp, c, args.new_tokens, args.rounds, compile, args.device)
            if want is None:
                base, want = rate, outputs
            assert outputs == want, f"tp {tp} changed the greedy output"
            step = "compiled" if compile == "auto" else "eager"
            rows.append({"tp": tp, "step": step, "concurrency": c, "tokens_per_s": rate,
                         "ratio_to_tp1_eager": rate / base, "step_ms": 1e3 * c / rate})
            print(f"  c={c:<3d} tp={tp} {step:8s} {rate:8.1f} tok/s  step {1e3 * c / rate:6.2f} ms  "
                  f"x{rate / base:.2f} of tp=1 eager", flush=True)
    served = []
    if not args.no_serving:
        print(f"\nserving: batonlm bench, 64 in / 64 out, {args.serving_concurrency} at once, "
              f"{args.serving_prompts} requests:")
        served = serving(args.model, args.serving_concurrency, args.serving_prompts, args.device)
    out = {"machine": platform.processor() or platform.machine(), "device": args.device, "model": args.model,
           "ranks": args.ranks,
           "micro_seconds": res, "decode": rows, "serving": served}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
