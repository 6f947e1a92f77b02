"""The FP8 KV cache's per-layer scales, read from the checkpoint when it has them.

Checkpoints quantized for an FP8 KV cache hold one float32 scalar per layer and kind: vLLM's and
llm-compressor's `model.layers.N.self_attn.k_scale` and `.v_scale`, AutoFP8's single `.kv_scale`
for both, the `k_proj.output_scale` / `v_proj.output_scale` of older compressed-tensors and Quark
checkpoints, ModelOpt's `k_proj.k_scale` / `v_proj.v_scale` (`KV_SCALE_NAMES`): the cache stores
`k / k_scale` and reads back `stored * k_scale`. The weight loader passes over these tensors;
they are read here, for the KV pool. A layer without one gets 1.0, with one warning line at
start-up.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

from batonlm.model_runner.weight_loader import (
    KV_SCALE_NAMES,
    KV_SCALE_SUFFIXES,
    WeightLoadError,
    checkpoint_files,
)

logger = logging.getLogger(__name__)

_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(" + "|".join(map(re.escape, KV_SCALE_NAMES)) + ")$")


@dataclass(frozen=True)
class KVScales:
    k: tuple[float, ...]  # per layer
    v: tuple[float, ...]
    missing: tuple[str, ...]  # "k_scale of layer 3", ...: those set to 1.0


def read_kv_scales(model_dir: str | Path, num_layers: int) -> KVScales:
    """Every layer's k and v scale from the checkpoint's `KV_SCALE_SUFFIXES` tensors (a
    layer's own k_scale / v_scale before its kv_scale), 1.0 where it has none. Raises
    WeightLoadError naming a scale that is not a positive finite scalar or names no layer."""
    found: dict[tuple[int, str], float] = {}
    problems = []
    for f in checkpoint_files(model_dir):
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                if not name.endswith(KV_SCALE_SUFFIXES):
                    continue
                m = _NAME.search(name)
                t = sf.get_tensor(name)
                if m is None or int(m.group(1)) >= num_layers:
                    problems.append(f"{name}: no layer of the model's {num_layers} has this name")
                elif t.numel() != 1:
                    problems.append(f"{name}: a KV scale is one number, this has shape {tuple(t.shape)}")
                elif not (float(t) > 0 and float(t) != float("inf")):
                    problems.append(f"{name}: {float(t)}, a KV scale must be positive and finite")
                else:
                    found[(int(m.group(1)), KV_SCALE_NAMES[m.group(2)])] = float(t)
    if problems:
        raise WeightLoadError(f"checkpoint in {str(model_dir)!r} has bad KV cache scales: " + "; ".join(problems))
    scales: dict[str, list[float]] = {"k": [], "v": []}
    missing = []
    for layer in range(num_layers):
        for kind in ("k", "v"):
            value = found.get((layer, kind), found.get((layer, "kv")))
            if value is None:
                missing.append(f"{kind}_scale of layer {layer}")
            scales[kind].append(1.0 if value is None else value)
    return KVScales(tuple(scales["k"]), tuple(scales["v"]), tuple(missing))


def warn_missing(scales: KVScales, cache_dtype_name: str, max_value: float) -> None:
    """The one start-up line saying which scales are 1.0 (none: nothing)."""
    if not scales.missing:
        return
    if len(scales.missing) == 2 * len(scales.k):
        what = "the checkpoint has no KV cache scales"
    else:
        shown = scales.missing[:4]
        more = f" and {len(scales.missing) - len(shown)} more" if len(scales.missing) > len(shown) else ""
        what = f"the checkpoint has no {', '.join(shown)}{more}"
    logger.warning("%s KV cache: %s; using 1.0 (keys and values beyond +-%g saturate there)",
                   cache_dtype_name, what, max_value)
