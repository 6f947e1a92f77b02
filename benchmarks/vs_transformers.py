"""batonlm against Hugging Face transformers `generate` (static batches), side by side.

Same model, same prompts, greedy, the same number of new tokens for every request (EOS
ignored). For each concurrency N, transformers runs the N prompts as one left-padded static
batch; batonlm (the in-process Engine: scheduler process + CPU device worker, overlap loop)
gets the N requests at once. Reported: output tokens/s for both and their ratio, and the
per-step decode latency at batch 1 (transformers: (time for 1 + K tokens - time for 1 token) / K;
batonlm: median inter-token latency of a streamed request).

Models: the embedded stories260K, and a ~32M-parameter random-weight Llama built from
configs/bench-models/llama-30m.json (the stories tokenizer, vocabulary 512).

    python benchmarks/vs_transformers.py [--models stories260K llama-30m] [--concurrency 1 16 64]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import batonlm
from batonlm.config import EMBEDDED_MODEL

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CORPUS = ROOT / "batonlm" / "bench" / "data" / "corpus.txt"


def build_random_llama(config_file: Path, out: Path) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = json.loads(config_file.read_text())
    model_type = raw.pop("model_type")
    raw.pop("architectures")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **raw)).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(Path(EMBEDDED_MODEL) / name, out / name)
    return str(out)


def prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    ids = tokenizer(CORPUS.read_text()[:200_000]).input_ids
    return [[1] + ids[i * length : (i + 1) * length - 1] for i in range(n)]


def hf_run(model, batch: list[list[int]], new_tokens: int) -> float:
    """Seconds for one static batch (left padding) to generate `new_tokens` each."""
    width = max(len(p) for p in batch)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, pad_token_id=0)
    elapsed = time.perf_counter() - t0
    assert out.shape[1] == width + new_tokens
    return elapsed


def bench_hf(path: str, all_prompts: list[list[int]], concurrency: list[int], new_tokens: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf_run(model, all_prompts[:2], 4)  # warm-up
    throughput = {c: c * new_tokens / hf_run(model, all_prompts[:c], new_tokens) for c in concurrency}
    one = statistics.median(hf_run(model, all_prompts[:1], 1) for _ in range(3))
    full = statistics.median(hf_run(model, all_prompts[:1], new_tokens + 1) for _ in range(3))
    return {"tokens_per_s": throughput, "step_ms_batch1": 1e3 * (full - one) / new_tokens}


def bench_batonlm(path: str, all_prompts: list[list[int]], concurrency: list[int], new_tokens: int) -> dict:
    params = {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}
    with batonlm.Engine(path, max_running_requests=max(concurrency)) as engine:
        engine.generate(input_ids=all_prompts[:2], sampling_params={**params, "max_new_tokens": 4})  # warm-up
        throughput = {}
        for c in concurrency:
            t0 = time.perf_counter()
            outs = engine.generate(input_ids=all_prompts[:c], sampling_params=params)
            elapsed = time.perf_counter() - t0
            assert all(o["completion_tokens"] == new_tokens for o in outs)
            throughput[c] = c * new_tokens / elapsed
        gaps = []
        for _ in range(3):
            stamps = [time.perf_counter() for _ in engine.generate_stream(input_ids=all_prompts[0], sampling_params=params)]
            gaps += [b - a for a, b in zip(stamps[1:], stamps[2:])]
    return {"tokens_per_s": throughput, "step_ms_batch1": 1e3 * statistics.median(gaps)}


def plot(rows: list[dict], concurrency: list[int], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rows) + 1, figsize=(5 * (len(rows) + 1), 4))
    for ax, r in zip(axes, rows):
        x = range(len(concurrency))
        ax.bar([i - 0.2 for i in x], [r["transformers"]["tokens_per_s"][c] for c in concurrency], 0.4, label="transformers")
        ax.bar([i + 0.2 for i in x], [r["batonlm"]["tokens_per_s"][c] for c in concurrency], 0.4, label="batonlm")
        ax.set_xticks(list(x), [str(c) for c in concurrency])
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("output tokens/s")
        ax.set_title(r["model"])
        ax.legend()
    ax = axes[-1]
    names = [r["model"] for r in rows]
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [r["transformers"]["step_ms_batch1"] for r in rows], 0.4, label="transformers")
    ax.bar([i + 0.2 for i in x], [r["batonlm"]["step_ms_batch1"] for r in rows], 0.4, label="batonlm")
    ax.set_xticks(list(x), names)
    ax.set_ylabel("decode step at batch 1 (ms)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["stories260K", "llama-30m"], choices=["stories260K", "llama-30m"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-json", default=str(RESULTS / "local" / "vs_transformers.json"))
    args = ap.parse_args()

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_MODEL)
    all_prompts = prompts(tokenizer, max(args.concurrency), args.prompt_len)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            path = EMBEDDED_MODEL if name == "stories260K" else build_random_llama(
                ROOT / "configs" / "bench-models" / f"{name}.json", Path(tmp) / name)
            hf = bench_hf(path, all_prompts, args.concurrency, args.new_tokens)
            ours = bench_batonlm(path, all_prompts, args.concurrency, args.new_tokens)
            rows.append({"model": name, "transformers": hf, "batonlm": ours})

    print(f"\nbatonlm vs transformers generate: {args.new_tokens} new tokens per request, greedy, "
          f"prompts of {args.prompt_len} tokens, {os.cpu_count()} CPUs, torch {torch.__version__}\n")
    head = f"{'model':<12} | {'concurrency':>11} | {'transformers tok/s':>18} | {'batonlm tok/s':>13} | {'ratio':>6}"
    print(head)
    print("-" * len(head))
    for r in rows:
        for c in args.concurrency:
            hf, ours = r["transformers"]["tokens_per_s"][c], r["batonlm"]["tokens_per_s"][c]
            print(f"{r['model']:<12} | {c:>11} | {hf:>18.0f} | {ours:>13.0f} | {ours / hf:>5.2f}x")
    print()
    head = f"{'model':<12} | {'transformers step ms':>20} | {'batonlm step ms':>15} | {'batonlm/transformers':>20}"
    print(head)
    print("-" * len(head))
    for r in rows:
        hf, ours = r["transformers"]["step_ms_batch1"], r["batonlm"]["step_ms_batch1"]
        print(f"{r['model']:<12} | {hf:>20.3f} | {ours:>15.3f} | {ours / hf:>20.2f}")
    out = Path(args.output_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "vs_transformers",
        "new_tokens": args.new_tokens,
        "prompt_len": args.prompt_len,
        "concurrency": args.concurrency,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "command": "python benchmarks/vs_transformers.py " + " ".join(sys.argv[1:]),
        "rows": rows,
    }, indent=2))
    png = out.with_suffix(".png")
    plot(rows, args.concurrency, png)
    print(f"\nwrote {out} and {png}")


if __name__ == "__main__":
    main()
