"""Speculative decoding with n-gram drafts: decode tokens/s with speculation on vs off, side by
side in one run, and how many drafts a verification accepts.

Workloads, greedy, `--new-tokens` tokens each (EOS ignored), `--concurrency` requests at once
on one scheduler and its CPU device worker (the server's defaults: overlap loop, compiled decode
step where it pays):
  * copy: a model whose output repeats a text (a synthetic one-layer model whose greedy output
    cycles through 36 tokens; the prompt holds the text once), the best case: drafts from the
    prompt are right, as when a model quotes, edits or extracts from its context;
  * repetitive: stories260K on prompts that repeat a sentence of the bench corpus three times;
  * plain: stories260K on passages of the bench corpus (what `batonlm bench` sends).
Rounds alternate off / on on the same scheduler and prompts (outputs checked equal); the median
of `--rounds` is reported, with the ratio on / off, the drafts accepted per verification step
and output tokens per forward.

    python benchmarks/speculative.py [--concurrency 1 4] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from batonlm.bench.datasets import Corpus, load_tokenizer
from batonlm.config import EMBEDDED_MODEL, ServerArgs
from batonlm.ipc.messages import GenerateRequest
from batonlm.sampling_params import SamplingParams
from batonlm.scheduler.local_io import LocalIO
from batonlm.scheduler.process import build_scheduler
from batonlm.scheduler.speculative import SpecConfig, Speculator

RESULTS = Path(__file__).resolve().parent / "results"


def prompts(model: str, n: int, length: int, repetitive: bool, seed: int = 0) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    corpus = Corpus(load_tokenizer(model))
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        text, _ = corpus.sample(rng, length)
        if repetitive:  # a sentence of the passage, three times: the model keeps repeating it
            sentence = max(text.split(". "), key=len).strip(" .") + "."
            text = " ".join([sentence] * 3)
        out.append(tok(text).input_ids)
    return out


def copy_model(root: Path) -> tuple[str, list[list[int]]]:
    """The synthetic copying model (tests/helpers.py builds it) and its prompts."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from helpers import build_byte_cycle_model, copy_tokenizer

    path = root / "cycle"
    cycle = build_byte_cycle_model(path, "abcdefghijklmnopqrstuvwxyz0123456789")
    copy_tokenizer(path)
    return str(path), [[1, *cycle, *cycle[: 3 + i]] for i in range(8)]


def run_once(sched, io: LocalIO, batch: list[list[int]], new_tokens: int) -> dict:
    for i, ids in enumerate(batch):
        params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        io.submit(GenerateRequest(f"r{i}", ids, params), sched.iteration)
    batches0 = sched.timing.batches
    t0 = time.perf_counter()
    sched.event_loop_overlap()
    wall = time.perf_counter() - t0
    tokens = sum(len(r.token_ids) for r in io.records.values())
    outputs = {rid: list(r.token_ids) for rid, r in io.records.items()}
    io.records.clear()
    return {"tokens_per_s": tokens / wall, "tokens": tokens, "forwards": sched.timing.batches - batches0,
            "outputs": outputs}


def measure(sched, io: LocalIO, spec_config: SpecConfig, workload: str, batch: list[list[int]], args) -> dict:
    run_once(sched, io, batch, 8)  # warm-up
    off, on = [], []
    for _ in range(args.rounds):
        sched.speculator = sched.planner.speculator = None
        a = run_once(sched, io, batch, args.new_tokens)
        sched.speculator = sched.planner.speculator = Speculator(spec_config)
        b = run_once(sched, io, batch, args.new_tokens)
        assert a["outputs"] == b["outputs"], "speculation changed the greedy output"
        off.append(a["tokens_per_s"])
        on.append(b["tokens_per_s"])
    st = sched.speculator.stats
    row = {
        "workload": workload, "concurrency": len(batch),
        "off_tokens_per_s": statistics.median(off), "on_tokens_per_s": statistics.median(on),
        "accepted_per_verify": st.accepted / max(1, st.steps), "verify_steps": st.steps,
        "accept_hist": st.hist, "tokens_per_forward": b["tokens"] / max(1, b["forwards"]),
        "cost_ratio": sched.speculator.cost_ratio,
    }
    row["ratio"] = row["on_tokens_per_s"] / row["off_tokens_per_s"]
    print(f"{workload:10s} c={len(batch):<3d} off {row['off_tokens_per_s']:8.1f} tok/s   on "
          f"{row['on_tokens_per_s']:8.1f} tok/s   x{row['ratio']:.2f}   accepted/verify "
          f"{row['accepted_per_verify']:.2f}  tokens/forward {row['tokens_per_forward']:.2f}  "
          f"cost ratio {row['cost_ratio']:.2f}  hist {st.hist}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=EMBEDDED_MODEL)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--new-tokens", type=int, default=200)
    ap.add_argument("--prompt-tokens", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=str(RESULTS / "local" / "speculative.json"))
    args = ap.parse_args()

    spec_config = SpecConfig()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cycle_path, cycle_prompts = copy_model(Path(tmp))
        for workload, model in (("copy", cycle_path), ("repetitive", args.model), ("plain", args.model)):
            io = LocalIO()
            sched, _ = build_scheduler(ServerArgs(model=model), io)
            io.bind(lambda s=sched: s.iteration)
            try:
                for n in args.concurrency:
                    if workload == "copy":
                        batch = cycle_prompts[:n]
                    else:
                        batch = prompts(model, n, args.prompt_tokens, workload == "repetitive", seed=n)
                    rows.append(measure(sched, io, spec_config, workload, batch, args))
            finally:
                sched.device.close()
    out = {"machine": platform.processor() or platform.machine(), "model": args.model,
           "spec": dataclasses.asdict(spec_config), "new_tokens": args.new_tokens, "rows": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
