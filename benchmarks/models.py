"""Model families on the CPU: the MoE layer's formulations, and decode tok/s per family.

Part 1, the mixture-of-experts layer alone (batonlm/kernels/moe.py), float32, every core:
per-expert loop (transformers' eager experts: one expert at a time over its rows, indexed
accumulation) vs batonlm's grouped path (pairs sorted by expert once, one matmul pair per expert
with rows) vs the dense path (every expert over every token, what the compiled step traces), at
T tokens; median of `--rounds`, the three alternating in each round.

Part 2, each family end to end: a random model of the family at one small shape (hidden 256,
4 layers; the MoE families 8 experts, top 2; DeepSeek's latent 128 + 16) served by `batonlm.Engine` (eager step, overlap
loop), B streams of `--new-tokens` greedy tokens each (EOS ignored); output tok/s over the
whole batch (prefill included), median of `--rounds`; with `--fallback` each family on
transformers' modeling code too (batonlm's cache and scheduler, `--model-impl transformers`).

    python benchmarks/models.py [--batch 1 16] [--tokens 1 16 64 256] [--fallback] [--json out.json]
    python benchmarks/models.py --device cuda --dtype bfloat16   # + the Triton grouped GEMM
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "benchmarks"))
from vs_transformers import build_random_llama  # noqa: E402

from batonlm.kernels.moe import (  # noqa: E402
    fused_moe_dense,
    fused_moe_grouped,
    fused_moe_reference,
    fused_moe_triton,
)

TEST_MODELS = ROOT / "configs" / "test-models"
SHAPE = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 4, "head_dim": 32, "moe_intermediate_size": 128, "num_experts": 8,
         "num_local_experts": 8, "n_routed_experts": 8, "num_experts_per_tok": 2,
         # DeepSeek's latent attention: a 128-feature latent plus 16 rotary (V3's query low-rank).
         "kv_lora_rank": 128, "q_lora_rank": 96, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32}


def moe_layer(tokens: list[int], rounds: int, experts: int, top_k: int, hidden: int, inter: int,
              device: str, dtype: torch.dtype) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(device, dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) / inter**0.5).to(device, dtype)
    ways = {"per-expert loop": fused_moe_reference, "grouped": fused_moe_grouped, "dense": fused_moe_dense}
    if device.startswith("cuda"):
        ways["triton"] = fused_moe_triton
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    rows = []
    for t in tokens:
        x = torch.randn(t, hidden, generator=g).to(device, dtype)
        ids = torch.rand(t, experts, generator=g).topk(top_k, dim=1).indices.to(device)
        weights = torch.rand(t, top_k, generator=g).to(device, dtype)
        times: dict[str, list[float]] = {k: [] for k in ways}
        for fn in ways.values():  # warm (allocator, thread pool, kernel compile)
            fn(x, w13, w2, ids, weights, F.silu)
        for _ in range(rounds):
            for name, fn in ways.items():
                sync()
                t0 = time.perf_counter()
                fn(x, w13, w2, ids, weights, F.silu)
                sync()
                times[name].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        rows.append({"tokens": t, **{f"{k} ms": round(v, 3) for k, v in med.items()},
                     **{f"{k} / loop": round(med[k] / med["per-expert loop"], 2) for k in ways if k != "per-expert loop"}})
    return rows


def build_family(family: str, out: Path) -> str:
    """A random model of the family's test config (configs/test-models/) at the SHAPE above."""
    raw = json.loads((TEST_MODELS / f"{family}.json").read_text())
    raw.update({k: v for k, v in SHAPE.items() if raw.get(k) is not None or (k == "head_dim" and "kv_lora_rank" not in raw)})
    raw.pop("mlp_only_layers", None)
    layers = raw["num_hidden_layers"]
    if raw.get("layer_types"):  # the test config's pattern (sliding, global) over every layer
        raw["layer_types"] = [raw["layer_types"][i % len(raw["layer_types"])] for i in range(layers)]
    scaling = raw.get("rope_scaling") or {}
    if scaling.get("short_factor"):  # LongRoPE: a factor per rotated frequency of the new head dim
        pairs = int(raw["head_dim"] * raw.get("partial_rotary_factor", 1.0)) // 2
        for key in ("short_factor", "long_factor"):
            old = scaling[key]
            scaling[key] = [old[i * len(old) // pairs] for i in range(pairs)]
    config_file = out.parent / f"{family}.json"
    config_file.write_text(json.dumps(raw))
    return build_random_llama(config_file, out)


def family_decode(families: list[str], batches: list[int], new_tokens: int, rounds: int, device: str,
                  dtype: str, fallback: bool = False) -> list[dict]:
    """Rows of (family, code, streams, tok/s): batonlm's native code, and with `fallback`
    transformers' modeling code on batonlm's cache (`--model-impl transformers`) beside it."""
    from batonlm import Engine

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in families:
            path = build_family(family, Path(tmp) / family)
            impls = ["native", "transformers"] if fallback and "kv_lora_rank" not in json.loads(
                (Path(path) / "config.json").read_text()) else ["native"]  # MLA: native only
            for impl in impls:
                engine = Engine(path, compile="off", max_running_requests=max(batches), device=device, dtype=dtype,
                                model_impl=impl)
                try:
                    for b in batches:
                        rows.append({"family": family, "code": impl, "streams": b,
                                     "tok/s": stream_tok_s(engine, b, new_tokens, rounds)})
                finally:
                    engine.shutdown()
    return rows


def stream_tok_s(engine, streams: int, new_tokens: int, rounds: int) -> float:
    """Output tok/s of `streams` greedy streams of `new_tokens` each (EOS ignored, prefill
    included), median of `rounds` after a warm-up request."""
    ids = [[1] + [3 + (7 * i + j) % 500 for j in range(31)] for i in range(streams)]
    params = {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}
    engine.generate(input_ids=ids[:1], sampling_params=params)  # warm
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        out = engine.generate(input_ids=ids, sampling_params=params)
        times.append(time.perf_counter() - t0)
        assert all(o["completion_tokens"] == new_tokens for o in out)
    return round(streams * new_tokens / statistics.median(times), 1)


def table(rows: list[dict]) -> str:
    keys = list(rows[0])
    lines = [" | ".join(keys), " | ".join("---" for _ in keys)]
    lines += [" | ".join(str(r[k]) for k in keys) for r in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--moe-shape", type=int, nargs=4, default=[64, 8, 1024, 256],
                    metavar=("EXPERTS", "TOP_K", "HIDDEN", "INTERMEDIATE"))
    ap.add_argument("--families", nargs="+", default=sorted(p.stem for p in TEST_MODELS.glob("*.json")))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (adds the Triton grouped GEMM)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--fallback", action="store_true",
                    help="also each family on transformers' modeling code (--model-impl transformers)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    e, k, h, i = args.moe_shape
    where = f"{torch.get_num_threads()} threads" if args.device == "cpu" else args.device
    print(f"MoE layer: {e} experts, top {k}, hidden {h}, expert intermediate {i}, {args.dtype}, {where}")
    moe = moe_layer(args.tokens, args.rounds, e, k, h, i, args.device, getattr(torch, args.dtype))
    print(table(moe))
    print(f"\nDecode per family (hidden 256, 4 layers, eager step, overlap loop), {args.new_tokens} new tokens "
          f"per stream")
    fams = family_decode(args.families, args.batch, args.new_tokens, args.rounds, args.device, args.dtype,
                         args.fallback)
    print(table(fams))
    if args.json:
        args.json.write_text(json.dumps({"moe_layer": moe, "families": fams}, indent=2))


if __name__ == "__main__":
    main()
