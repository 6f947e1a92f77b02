"""Strict safetensors loading: every parameter filled, every tensor used, every shape checked.

Under tensor parallelism each rank reads only its part of each tensor (safetensors slices:
rows of column-parallel weights, columns of row-parallel ones, rows of the vocabulary), so a
rank's bytes read are about its share of the checkpoint (`LoadStats`).
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from batonlm.model_runner.checkpoint import Checkpoint
from batonlm.model_runner.layers import GatedMLP
from batonlm.model_runner.models.base import CausalLM
from batonlm.model_runner.moe import FusedExperts
from batonlm.model_runner.quantization.config import QuantConfig
from batonlm.model_runner.text_decoders import MULTIMODAL_TEXT_DECODERS

logger = logging.getLogger(__name__)

# Checkpoints above this size get a progress bar.
PROGRESS_BAR_BYTES = 64 * 1024 * 1024
# The FP8 KV cache's per-layer scales: not weights; kv_scales.py reads them for the KV pool.
# The name after `layers.N.self_attn.` -> the scale it is: vLLM's and llm-compressor's own,
# AutoFP8's one for keys and values, the output scales of k_proj / v_proj (compressed-tensors'
# older checkpoints, Quark), ModelOpt's on the projections, and a fused qkv_proj's (Phi-3).
KV_SCALE_NAMES = {
    "k_scale": "k", "v_scale": "v", "kv_scale": "kv",
    "k_proj.output_scale": "k", "v_proj.output_scale": "v",
    "k_proj.k_scale": "k", "v_proj.v_scale": "v", "qkv_proj.k_scale": "k", "qkv_proj.v_scale": "v",
}
KV_SCALE_SUFFIXES = tuple(f"self_attn.{name}" for name in KV_SCALE_NAMES)
# The queries' scales of the same exporters: for attention over FP8 queries, which batonlm does
# not run (queries stay in the model's dtype); passed over, not refused.
QUERY_SCALE_SUFFIXES = ("self_attn.q_scale", "self_attn.q_proj.output_scale")
# Buffers some exporters save that carry no weights, and the tensors read elsewhere.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", *KV_SCALE_SUFFIXES, *QUERY_SCALE_SUFFIXES)


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


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: its elements [start, start + count) along `dim` (0:
    rows, 1: columns; `full` of them in the checkpoint) fill rows [offset, offset + count) of
    `param` (dim 0) or the whole of it (dim 1)."""

    param: torch.Tensor
    offset: int
    count: int
    dim: int = 0
    start: int = 0
    full: int | None = None  # the checkpoint's size along `dim` (None: count)

    def expected_shape(self) -> tuple[int, ...]:
        shape = list(self.param.shape)
        shape[self.dim] = self.full if self.full is not None else self.count
        return tuple(shape)


@dataclass(frozen=True)
class LoadStats:
    bytes_read: int  # what this rank read from the checkpoint
    checkpoint_bytes: int  # the checkpoint's tensors, all of them


def weight_targets(model: CausalLM) -> dict[str, Target | list[Target]]:
    """Checkpoint tensor name -> where this rank's part of it goes (a list: a fused checkpoint
    tensor whose row ranges go to several places, Phi-3's qkv_proj under tensor parallelism)."""
    shard, cfg = model.shard, model.config
    q_start, _ = shard.q_rows()
    kv_start, _ = shard.kv_rows()
    vocab_start, vocab_count = shard.vocab_rows_in_checkpoint()
    q_full, kv_full = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    starts = {"q_proj": (q_start, q_full), "k_proj": (kv_start, kv_full), "v_proj": (kv_start, kv_full)}
    out: dict[str, Target | list[Target]] = {}
    for param_name, p in model.named_parameters():
        name = checkpoint_name(model, param_name)
        special = model.weight_target(param_name, name, p)
        if special is not None:
            out[name] = special
            continue
        if param_name.endswith(_EXPERT_PARAMS):
            out.update(_expert_targets(model, param_name, name, p))
            continue
        owner = model.get_submodule(param_name.rsplit(".", 2)[0]) if "_proj." in param_name else None
        if isinstance(owner, GatedMLP):  # its own slice of its own features (an MLP, a shared expert)
            out.update(_mlp_targets(owner, param_name, name, p))
            continue
        fused = next((f for f, _, _ in model.stacked_params if f"{f}." in name), None)
        if fused is not None:
            sizes = model.shard_sizes(fused)
            for f, src, index in model.stacked_params:
                if f == fused:
                    start, full = starts[src]
                    out[name.replace(f"{fused}.", f"{src}.")] = Target(
                        p, sum(sizes[:index]), sizes[index], 0, start, full
                    )
        elif name.endswith("o_proj.weight"):  # row-parallel: its columns
            out[name] = Target(p, 0, p.shape[1], 1, q_start, q_full)
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):  # its vocabulary rows
            out[name] = Target(p, 0, vocab_count, 0, vocab_start, cfg.vocab_size)
            with torch.no_grad():
                p[vocab_count:].zero_()  # the padding rows past the vocabulary
        else:
            out[name] = Target(p, 0, p.shape[0])
    return out


_EXPERT_PARAMS = ("experts.w13", "experts.w2")


def checkpoint_name(model: CausalLM, name: str) -> str:
    """A parameter's or module's name as the checkpoint spells it."""
    for ours, theirs in model.checkpoint_renames:
        name = name.replace(ours, theirs)
    return name


def _expert_targets(model: CausalLM, param_name: str, name: str, p: torch.Tensor) -> dict[str, Target]:
    """The fused experts' parameter `param_name` (checkpoint prefix from `name`): expert e's gate
    and up projections fill rows of w13[e] (this rank's slice of each), its down projection
    w2[e] (this rank's columns)."""
    module, _, kind = param_name.rpartition(".")
    experts = model.get_submodule(module)
    assert isinstance(experts, FusedExperts), param_name
    start, count = experts.rows
    full = experts.intermediate
    prefix = name.rpartition(".")[0]
    gate, up, down = model.expert_weight_names
    out: dict[str, Target] = {}
    for e in range(p.shape[0]):
        view = p.data[e]
        if kind == "w13":
            out[f"{prefix}.{e}.{gate}.weight"] = Target(view, 0, count, 0, start, full)
            out[f"{prefix}.{e}.{up}.weight"] = Target(view, count, count, 0, start, full)
        else:
            out[f"{prefix}.{e}.{down}.weight"] = Target(view, 0, count, 1, start, full)
    return out


def _mlp_targets(mlp: GatedMLP, param_name: str, name: str, p: torch.Tensor) -> dict[str, Target]:
    """A gated MLP's slice of intermediate features (`checkpoint_rows`): rows of its gate and up
    projections (fused, weight and bias), columns of its down projection (its bias whole)."""
    start, full = mlp.checkpoint_rows
    count = mlp.intermediate
    if ".gate_up_proj." in param_name:
        return {name.replace(".gate_up_proj.", ".gate_proj."): Target(p, 0, count, 0, start, full),
                name.replace(".gate_up_proj.", ".up_proj."): Target(p, count, count, 0, start, full)}
    if param_name.endswith("down_proj.weight"):
        return {name: Target(p, 0, count, 1, start, full)}
    return {name: Target(p, 0, p.shape[0])}  # down_proj's bias, added once after the sum


def _read(ckpt: Checkpoint, name: str, t: Target) -> torch.Tensor:
    """This rank's part of a checkpoint tensor, read alone (not the whole tensor)."""
    if t.full is None:
        return ckpt.read(name)
    return ckpt.read(name, t.dim, t.start, t.count)


def _missing_prefix(names: list[str], targets: dict[str, Target | list[Target]]) -> str:
    """"model." when the checkpoint is a base model's (its decoder's tensors named without the
    prefix: `layers.0...`, not `model.layers.0...`, as embedding models are saved), else ""."""
    ours = any(t.startswith("model.") for t in targets)
    return "model." if ours and names and not any(n.startswith("model.") for n in names) else ""


def open_checkpoint(files: list[Path], quant: QuantConfig | None) -> Checkpoint:
    """The checkpoint's tensors as float ones: as stored, or through the quantized formats'
    dequantizing view."""
    if quant is None:
        return Checkpoint(files)
    from batonlm.model_runner.quantization.dequantized import DequantizedCheckpoint

    return DequantizedCheckpoint(files, quant)


def load_weights(
    model: CausalLM, model_dir: str | Path, dtype: torch.dtype, quant: QuantConfig | None = None,
    elsewhere: frozenset[str] = frozenset(),
) -> LoadStats:
    """Fill every parameter of `model` (this rank's part of it) from the directory's
    safetensors, strictly; a quantized checkpoint's layers dequantized (`quant`). `elsewhere`:
    checkpoint (float view) names another loader fills (quantized layers kept quantized)."""
    files = checkpoint_files(model_dir)
    targets = weight_targets(model)
    tied = model.lm_head is None
    loaded: set[str] = set()
    unexpected: list[str] = []
    misshapen: list[str] = []
    total = sum(f.stat().st_size for f in files)
    bytes_read = checkpoint_bytes = 0
    # tqdm's default lock holds a multiprocessing semaphore, which a worker killed while it
    # loads (a cancelled start) never unlinks: the resource tracker then warns of a leaked
    # semaphore as the server exits. One thread draws this bar: a thread lock does.
    tqdm.set_lock(threading.RLock())
    bar = tqdm(
        total=total, unit="B", unit_scale=True, desc="Loading weights", disable=total < PROGRESS_BAR_BYTES
    )
    wrapper = model.config.text_decoder_of
    layout = MULTIMODAL_TEXT_DECODERS[wrapper] if wrapper is not None else None
    with torch.no_grad(), open_checkpoint(files, quant) as ckpt:
        ours_of = {n: n if layout is None else layout.decoder_name(n) for n in ckpt.names()}
        prefix = _missing_prefix([n for n in ours_of.values() if n is not None], targets)
        for f, names in ckpt.names_by_file():
            for name in names:
                ours = ours_of[name]
                if ours is None:  # a multimodal checkpoint's other modalities
                    continue
                if ours.endswith(_IGNORED_SUFFIXES) or (tied and ours == "lm_head.weight") or name in elsewhere:
                    continue
                found = targets.get(prefix + ours)
                if found is None:
                    unexpected.append(name)
                    continue
                shape = ckpt.shape(name)
                parts = found if isinstance(found, list) else [found]
                bad = [t.expected_shape() for t in parts if t.expected_shape() != shape]
                if bad:
                    misshapen.append(f"{name}: checkpoint {shape}, model expects {bad[0]}")
                    continue
                for target in parts:
                    tensor = _read(ckpt, name, target)
                    if target.dim == 0:
                        target.param.data[target.offset : target.offset + target.count].copy_(tensor.to(dtype))
                    else:
                        target.param.data.copy_(tensor.to(dtype))
                checkpoint_bytes += ckpt.nbytes(name)
                loaded.add(prefix + ours)
            bar.update(f.stat().st_size)
        bytes_read = ckpt.bytes_read
    bar.close()
    missing = sorted(set(targets) - loaded)
    problems = []
    for title, names in (("missing", missing), ("unexpected", unexpected), ("misshapen", misshapen)):
        if names:
            shown = names[:20] + ([f"... and {len(names) - 20} more"] if len(names) > 20 else [])
            problems.append(f"{len(names)} {title} tensor(s): " + "; ".join(shown))
    if problems:
        raise WeightLoadError(f"checkpoint in {str(model_dir)!r} does not fit the model: " + " | ".join(problems))
    logger.debug("loaded %d tensors from %d file(s), %d bytes", len(loaded), len(files), bytes_read)
    return LoadStats(bytes_read, checkpoint_bytes)
