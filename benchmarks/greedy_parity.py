"""Greedy tokens of batonlm against transformers on the CPU bench shapes (issue 31: every shape,
every path): stories260K, and random Llamas of the 25M and 100M shapes (configs/bench-models).

For each model, `--prompts` random prompts (token ids, seeded) continue for `--new-tokens` greedy
tokens (EOS ignored) in transformers (`generate`, one prompt at a time, `--dtype`) and in batonlm's
Engine with the decode step compiled and eager, the prompts one at a time (the one-row graph)
and all at once (the 2-64 graph). Printed: per model and path, the prompts whose tokens equal
transformers', and where the first one that does not parts from them (with transformers' top-1 /
top-2 logit margin there: a near-tie parts on rounding, a wrong step on anything). The row
"transformers, at once" is transformers' own batched run against its one-at-a-time one: in
bfloat16 it parts where the top two logits are one bfloat16 step apart.

    python benchmarks/greedy_parity.py [--models stories260K llama-25m llama-100m] [--prompts 4]
                                       [--new-tokens 32] [--dtype bfloat16] [--output-json FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_transformers import RESULTS, ROOT, build_random_llama  # noqa: E402

from batonlm.config import EMBEDDED_MODEL  # noqa: E402
from batonlm.engine import Engine  # noqa: E402


def hf_greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    outs = []
    with torch.no_grad():
        for ids in prompts:
            gen = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long))
            outs.append(gen[0, len(ids):].tolist())
    return outs


def hf_greedy_batched(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuations of all prompts as one left-padded batch: where they
    differ from its own one-at-a-time ones, the top two logits tie at the dtype's resolution."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        gen = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, pad_token_id=0)
    return [row[width:].tolist() for row in gen]


def margin(model, ids: list[int]) -> float:
    """transformers' top-1 minus top-2 logit after `ids`."""
    with torch.no_grad():
        top = model(torch.tensor([ids])).logits[0, -1].topk(2).values
    return float(top[0] - top[1])


def batonlm_greedy(path: str, compile_mode: str, prompts: list[list[int]], new_tokens: int,
                   together: bool, dtype: str) -> list[list[int]]:
    params = {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}
    with Engine(path, compile=compile_mode, dtype=dtype, max_running_requests=max(4, len(prompts))) as engine:
        if together:
            outs = engine.generate(input_ids=prompts, sampling_params=[params] * len(prompts))
        else:
            outs = [engine.generate(input_ids=ids, sampling_params=params) for ids in prompts]
    return [o["output_ids"] for o in outs]


def compare(model, prompts, want, got) -> dict:
    """Prompts with transformers' tokens; where each other one parts, and transformers' margin there."""
    same = [w == g for w, g in zip(want, got)]
    row: dict = {"identical": sum(same), "prompts": len(same), "divergences": []}
    for i, ok in enumerate(same):
        if not ok:
            at = next(j for j, (a, b) in enumerate(zip(want[i], got[i])) if a != b)
            row["divergences"].append({"prompt": i, "token": at, "hf_margin": margin(model, prompts[i] + want[i][:at])})
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["stories260K", "llama-25m", "llama-100m"],
                    choices=["stories260K", "llama-25m", "llama-30m", "llama-100m"])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--output-json", default=str(RESULTS / "local" / "greedy_parity.json"))
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    rng = random.Random(31)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            path = str(EMBEDDED_MODEL) if name == "stories260K" else build_random_llama(
                ROOT / "configs" / "bench-models" / f"{name}.json", Path(tmp) / name)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
            vocab = model.config.vocab_size
            prompts = [[1] + [rng.randrange(3, vocab) for _ in range(rng.randint(4, 40))] for _ in range(args.prompts)]
            want = hf_greedy(model, prompts, args.new_tokens)
            hf_batched = hf_greedy_batched(model, prompts, args.new_tokens)
            results.append({"model": name, "path": "transformers", "prompts_at_once": True,
                            **compare(model, prompts, want, hf_batched)})
            for compile_mode in ("on", "off"):
                for together in (False, True):
                    got = batonlm_greedy(path, compile_mode, prompts, args.new_tokens, together, args.dtype)
                    row = {"model": name, "path": "compiled" if compile_mode == "on" else "eager",
                           "prompts_at_once": together, **compare(model, prompts, want, got)}
                    results.append(row)
                    print(row, flush=True)
    print(f"\ngreedy tokens vs transformers, {args.prompts} prompts x {args.new_tokens} tokens, {args.dtype}, CPU\n")
    print(f"{'model':<12} | {'path':<12} | {'prompts':<10} | identical | where the others part (transformers' top-2 margin)")
    print("-" * 100)
    for r in results:
        where = ", ".join(f"{d['prompt']}@{d['token']} ({d['hf_margin']:.2e})" for d in r["divergences"]) or "-"
        print(f"{r['model']:<12} | {r['path']:<12} | {'at once' if r['prompts_at_once'] else 'one by one':<10} | "
              f"{r['identical']:>4} / {r['prompts']:<2} | {where}")
    out = Path(args.output_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"new_tokens": args.new_tokens, "dtype": args.dtype, "rows": results}, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
