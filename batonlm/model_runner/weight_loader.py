"""Strict safetensors loading: every parameter filled, every tensor used, every shape checked."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from batonlm.model_runner.models.decoder import DecoderLM

logger = logging.getLogger(__name__)

# Checkpoints above this size get a progress bar.
PROGRESS_BAR_BYTES = 64 * 1024 * 1024
# Buffers some exporters save that carry no weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class WeightLoadError(ValueError):
    """The checkpoint does not fit the model; the message names every offending tensor."""


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a model directory: sharded (with an index) or single."""
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise WeightLoadError(f"{index} has no weight_map")
        files = sorted({root / f for f in weight_map.values()})
        absent = [str(f.name) for f in files if not f.is_file()]
        if absent:
            raise WeightLoadError(f"{index} names shard files that do not exist: {', '.join(absent)}")
        return files
    single = root / "model.safetensors"
    if single.is_file():
        return [single]
    others = sorted(root.glob("*.safetensors"))
    if others:
        return others
    raise WeightLoadError(
        f"no safetensors weights in {str(root)!r} (expected model.safetensors or model.safetensors.index.json)"
    )


def _targets(model: DecoderLM) -> dict[str, tuple[torch.Tensor, int, int]]:
    """Checkpoint tensor name -> (destination parameter, row offset, row count)."""
    params = dict(model.named_parameters())
    out: dict[str, tuple[torch.Tensor, int, int]] = {}
    for name, p in params.items():
        fused = next((f for f, _, _ in model.stacked_params if f"{f}." in name), None)
        if fused is None:
            out[name] = (p, 0, p.shape[0])
            continue
        sizes = model.shard_sizes(fused)
        for f, src, shard in model.stacked_params:
            if f != fused:
                continue
            offset = sum(sizes[:shard])
            out[name.replace(f"{fused}.", f"{src}.")] = (p, offset, sizes[shard])
    return out


def load_weights(model: DecoderLM, model_dir: str | Path, dtype: torch.dtype) -> None:
    """Fill every parameter of `model` from the directory's safetensors, strictly."""
    files = checkpoint_files(model_dir)
    targets = _targets(model)
    tied = model.lm_head is None
    loaded: set[str] = set()
    unexpected: list[str] = []
    misshapen: list[str] = []
    total = sum(f.stat().st_size for f in files)
    bar = tqdm(
        total=total, unit="B", unit_scale=True, desc="Loading weights", disable=total < PROGRESS_BAR_BYTES
    )
    with torch.no_grad():
        for f in files:
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():
                    if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
                        continue
                    target = targets.get(name)
                    if target is None:
                        unexpected.append(name)
                        continue
                    param, offset, rows = target
                    expected = (rows, *param.shape[1:])
                    tensor = sf.get_tensor(name)
                    if tuple(tensor.shape) != expected:
                        misshapen.append(f"{name}: checkpoint {tuple(tensor.shape)}, model expects {expected}")
                        continue
                    param.data[offset : offset + rows].copy_(tensor.to(dtype))
                    loaded.add(name)
            bar.update(f.stat().st_size)
    bar.close()
    missing = sorted(set(targets) - loaded)
    problems = []
    for title, names in (("missing", missing), ("unexpected", unexpected), ("misshapen", misshapen)):
        if names:
            shown = names[:20] + ([f"... and {len(names) - 20} more"] if len(names) > 20 else [])
            problems.append(f"{len(names)} {title} tensor(s): " + "; ".join(shown))
    if problems:
        raise WeightLoadError(f"checkpoint in {str(model_dir)!r} does not fit the model: " + " | ".join(problems))
    logger.debug("loaded %d tensors from %d file(s)", len(loaded), len(files))
