"""LoRA adapters (PEFT checkpoints) applied per token, many in one batch.

An adapter is loaded into host memory, at start (`--lora-paths`) or at run time
(`/v1/load_lora_adapter`, up to `--max-loaded-loras` of them), and copied into one of the device's
`--max-loras-per-batch` slots when a request of it is admitted (the scheduler picks the slot:
batonlm/scheduler/lora_slots.py); slot 0 is the base model (no delta). For each layer and each
fused projection of the decoder (`qkv`: q/k/v; `o`; `gate_up`: gate/up; `down`)
the slots' weights are stacked: A [slots, R, in] and B [slots, out, R], R the largest rank
(smaller ranks zero-padded), B already scaled (lora_alpha / r, or / sqrt(r) with rsLoRA), and a
fused projection's parts stacked along R with B block-diagonal, so that one pair of matmuls
gives the delta of the whole fused output. A forward's tokens are grouped by slot once
(`LoRABatch`): per projection the work is one shrink and one expand matmul per adapter in the
batch (batonlm.kernels.lora: on a GPU two Triton launches for all of them), never a loop over
requests. Under tensor parallelism a rank holds its share (`_shards`): q/k/v and gate/up keep B's
rows of the rank, o and down A's columns, their partial deltas summed by the all-reduce.

The reference is PEFT: `x @ W.T + scale * (x @ A.T) @ B.T` for each adapted module.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from batonlm.distributed.layout import TPLayout
from batonlm.kernels.lora import lora_delta_reference, lora_delta_triton
from batonlm.model_runner.host_to_device import to_device
from batonlm.model_runner.model_config import ModelConfig
from batonlm.model_runner.model_loader import tp_layout

# Fused projection -> its parts (PEFT's target module names), in the order the fused output holds them.
FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
         "down": ("down_proj",)}
TARGETS = frozenset(m for parts in FUSED.values() for m in parts)


class LoRAError(ValueError):
    """An adapter that cannot be served (the message names the adapter and why)."""


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    path: str
    rank: int
    scale: float
    targets: frozenset[str]


def read_adapter(name: str, path: str, max_rank: int) -> AdapterSpec:
    """A PEFT LoRA adapter's config, checked."""
    root = Path(path)
    cfg_file = root / "adapter_config.json"
    if not cfg_file.is_file() or not (root / "adapter_model.safetensors").is_file():
        raise LoRAError(f"LoRA adapter {name!r}: {path} is not a PEFT adapter directory (adapter_config.json and "
                        "adapter_model.safetensors)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise LoRAError(f"LoRA adapter {name!r}: {cfg_file} is not valid JSON: {e}") from None
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"LoRA adapter {name!r}: peft_type {cfg.get('peft_type')!r} is not LORA")
    rank = int(cfg.get("r", 8))
    if rank > max_rank:
        raise LoRAError(f"LoRA adapter {name!r}: rank {rank} is over --max-lora-rank {max_rank}")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise LoRAError(f"LoRA adapter {name!r}: {key} (a rank or alpha per module) is not supported")
    if cfg.get("modules_to_save"):
        raise LoRAError(f"LoRA adapter {name!r}: modules_to_save (fully trained modules) is not supported")
    if cfg.get("bias", "none") != "none":
        raise LoRAError(f"LoRA adapter {name!r}: bias {cfg['bias']!r} is not supported (only none)")
    if cfg.get("use_dora"):
        raise LoRAError(f"LoRA adapter {name!r}: DoRA is not supported")
    targets = cfg.get("target_modules") or []
    targets = {targets} if isinstance(targets, str) else set(targets)
    unknown = targets - TARGETS
    if unknown:
        raise LoRAError(f"LoRA adapter {name!r}: target modules {sorted(unknown)} are not supported "
                        f"(supported: {sorted(TARGETS)})")
    alpha = float(cfg.get("lora_alpha", rank))
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return AdapterSpec(name, str(root.resolve()), rank, scale, frozenset(targets))


Sizes = dict[str, tuple[int, tuple[int, ...]]]  # fused projection -> (input features, each part's outputs)


def fused_sizes(cfg: ModelConfig, shard: TPLayout) -> Sizes:
    """The fused projections' sizes on a rank of `shard` (one rank of one: the checkpoint's)."""
    (_, q), (_, kv), (_, m) = shard.q_rows(), shard.kv_rows(), shard.mlp_rows()
    h = cfg.hidden_size
    return {"qkv": (h, (q, kv, kv)), "o": (q, (h,)), "gate_up": (h, (m, m)), "down": (m, (h,))}


@dataclass(frozen=True)
class _Module:
    """One adapted module of one layer: where its A and B are in the checkpoint (A [rank, fan_in],
    B [rows, rank]), and which part k of its fused projection it is."""

    layer: int
    fused: str
    k: int
    a_name: str
    b_name: str
    fan_in: int
    rows: int


def _modules(adapter: AdapterSpec, cfg: ModelConfig) -> Iterator[_Module]:
    sizes = fused_sizes(cfg, tp_layout(cfg, 0, 1))
    for layer in range(cfg.num_layers):
        for fused, parts in FUSED.items():
            fan_in, outs = sizes[fused]
            for k, part in enumerate(parts):
                if part in adapter.targets:
                    group = "self_attn" if fused in ("qkv", "o") else "mlp"
                    prefix = f"base_model.model.model.layers.{layer}.{group}.{part}"
                    yield _Module(layer, fused, k, f"{prefix}.lora_A.weight", f"{prefix}.lora_B.weight", fan_in,
                                  outs[k])


def adapted_projections(cfg: ModelConfig) -> tuple[str, ...]:
    """The fused projections an adapter may change: all of a dense model's; a mixture of
    experts' attention only (its experts are not adapted)."""
    return ("qkv", "o") if cfg.is_moe else tuple(FUSED)


def check_adapter(adapter: AdapterSpec, cfg: ModelConfig) -> None:
    """Every adapted module of every layer has its A and B, of the model's shapes, and nothing
    else is adapted (read from the file's header: no weight is loaded)."""
    allowed = {m for f in adapted_projections(cfg) for m in FUSED[f]}
    if adapter.targets - allowed:
        raise LoRAError(f"LoRA adapter {adapter.name!r}: target modules {sorted(adapter.targets - allowed)} are in "
                        f"the MLP of a mixture-of-experts model; adapters of its attention ({sorted(allowed)}) are "
                        "served")
    with safe_open(str(Path(adapter.path) / "adapter_model.safetensors"), framework="pt") as sf:
        names = set(sf.keys())
        want: set[str] = set()
        for m in _modules(adapter, cfg):
            if m.a_name not in names or m.b_name not in names:
                raise LoRAError(f"LoRA adapter {adapter.name!r}: {m.a_name.removesuffix('.lora_A.weight')} is a "
                                "target module but its lora_A / lora_B weights are missing")
            a, b = tuple(sf.get_slice(m.a_name).get_shape()), tuple(sf.get_slice(m.b_name).get_shape())
            if a != (adapter.rank, m.fan_in) or b != (m.rows, adapter.rank):
                raise LoRAError(f"LoRA adapter {adapter.name!r}: {m.a_name} and its B have shapes {a}, {b}, "
                                f"which do not fit the model ({(adapter.rank, m.fan_in)}, {(m.rows, adapter.rank)})")
            want.update((m.a_name, m.b_name))
    extra = sorted(n for n in names - want if ".lora_" in n)
    if extra:
        raise LoRAError(f"LoRA adapter {adapter.name!r}: weights of modules batonlm does not adapt: {extra[:4]}")


@dataclass(frozen=True)
class _Shard:
    """One part of a fused projection on this rank: the input features its A keeps (all of them
    for a column-parallel projection, this rank's for a row-parallel one), the output rows its
    B keeps, and where those rows go in the rank's fused output."""

    cols: slice
    rows: slice
    at: int


def _shards(shard: TPLayout) -> dict[str, tuple[_Shard, ...]]:
    """Each fused projection's parts on this rank, as the decoder splits the base weights: q/k/v
    and gate/up by output rows (A whole, B's rows), o and down by input features (A's columns,
    B whole: each rank's delta is a partial sum, added before the projection's all-reduce)."""
    (q0, q), (kv0, kv), (m0, m) = shard.q_rows(), shard.kv_rows(), shard.mlp_rows()
    every = slice(None)
    return {
        "qkv": (_Shard(every, slice(q0, q0 + q), 0), _Shard(every, slice(kv0, kv0 + kv), q),
                _Shard(every, slice(kv0, kv0 + kv), q + kv)),
        "o": (_Shard(slice(q0, q0 + q), every, 0),),
        "gate_up": (_Shard(every, slice(m0, m0 + m), 0), _Shard(every, slice(m0, m0 + m), m)),
        "down": (_Shard(slice(m0, m0 + m), every, 0),),
    }


Shape = tuple[int, int, int]


def slot_shapes(cfg: ModelConfig, shard: TPLayout, slots: int, rank: int) -> dict[str, tuple[Shape, Shape]]:
    """Per adapted fused projection, the shapes of one layer's stacked A [slots + 1, R', in] and
    B [out, slots + 1, R'] on this rank (R': its parts' ranks side by side)."""
    sizes = fused_sizes(cfg, shard)
    out: dict[str, tuple[Shape, Shape]] = {}
    for fused in adapted_projections(cfg):
        (fan_in, outs), r = sizes[fused], len(FUSED[fused]) * rank
        out[fused] = ((slots + 1, r, fan_in), (sum(outs), slots + 1, r))
    return out


def slot_bytes(cfg: ModelConfig, shard: TPLayout, slots: int, rank: int, dtype: torch.dtype) -> int:
    """The device memory `LoRAWeights` holds on a rank: every layer's stacked slots."""
    per_layer = sum(math.prod(a) + math.prod(b) for a, b in slot_shapes(cfg, shard, slots, rank).values())
    return cfg.num_layers * per_layer * torch.empty((), dtype=dtype).element_size()


class LoRAWeights:
    """The adapters' weights on this rank: every loaded adapter in host memory (`load`, by load
    key), and `slots` device slots (1..slots; slot 0 is the base model) stacked per layer and
    fused projection, each of rank up to `rank`, into which `place` copies a held adapter."""

    def __init__(self, slots: int, rank: int, cfg: ModelConfig, shard: TPLayout, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.cfg, self.rank, self.slots, self.device = cfg, rank, slots + 1, device
        self.shards = _shards(shard)
        self.a: dict[tuple[int, str], torch.Tensor] = {}  # [slots, R', in] (R': the parts' ranks)
        self.b: dict[tuple[int, str], torch.Tensor] = {}  # [slots, out, R'], a view of b_all
        self.b_all: dict[tuple[int, str], torch.Tensor] = {}  # [out, slots * R']: every slot's B, one matrix
        shapes = slot_shapes(cfg, shard, slots, rank)
        self.mlp = "gate_up" in shapes  # whether the MLPs are adapted (decoder.py asks)
        for layer in range(cfg.num_layers):
            for fused, (a_shape, b_shape) in shapes.items():
                self.a[layer, fused] = torch.zeros(a_shape, dtype=dtype, device=device)
                b_all = torch.zeros(b_shape, dtype=dtype, device=device)
                self.b[layer, fused] = b_all.permute(1, 0, 2)
                self.b_all[layer, fused] = b_all.view(b_shape[0], -1)
        # Load key -> its A and B per adapted (layer, fused projection), at a slot's layout.
        self.held: dict[int, dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]] = {}

    def load(self, key: int, adapter: AdapterSpec) -> None:
        """Read `adapter` (checked: `check_adapter`) into host memory (pinned for a GPU's copies)
        as load `key`."""
        assert adapter.rank <= self.rank, adapter.rank
        r, pin = self.rank, self.device.type == "cuda"
        held: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        with safe_open(str(Path(adapter.path) / "adapter_model.safetensors"), framework="pt") as sf:
            for m in _modules(adapter, self.cfg):
                if (m.layer, m.fused) not in held:
                    a0, b0 = self.a[m.layer, m.fused][0], self.b[m.layer, m.fused][0]
                    held[m.layer, m.fused] = (torch.zeros(a0.shape, dtype=a0.dtype, pin_memory=pin),
                                              torch.zeros(b0.shape, dtype=b0.dtype, pin_memory=pin))
                a, b = held[m.layer, m.fused]
                part = self.shards[m.fused][m.k]
                at = slice(m.k * r, m.k * r + adapter.rank)
                rows = sf.get_tensor(m.b_name)[part.rows] * adapter.scale
                a[at] = sf.get_tensor(m.a_name)[:, part.cols]
                b[part.at : part.at + rows.shape[0], at] = rows
        self.held[key] = held

    def place(self, slot: int, key: int) -> None:
        """Copy held load `key` into `slot`, over what it held (on a GPU, on the current stream:
        after the forwards launched before it)."""
        assert 1 <= slot < self.slots, slot
        held = self.held[key]
        for lf, a in self.a.items():
            if lf in held:
                a[slot].copy_(held[lf][0], non_blocking=True)
                self.b[lf][slot].copy_(held[lf][1], non_blocking=True)
            else:
                a[slot].zero_()
                self.b[lf][slot].zero_()

    def drop(self, key: int) -> None:
        """Free held load `key` (unloaded)."""
        self.held.pop(key, None)

    def batch(self, row_slots: list[int], row_tokens: list[int], device: torch.device) -> LoRABatch | None:
        """A forward's tokens grouped by adapter slot, from each row's slot and token count
        (None: every row on the base model)."""
        groups: dict[int, list[int]] = {}
        start = 0
        for s, n in zip(row_slots, row_tokens, strict=True):
            if s:
                groups.setdefault(s, []).extend(range(start, start + n))
            start += n
        if not groups:
            return None
        perm = [t for idx in groups.values() for t in idx]
        starts = [0]
        for idx in groups.values():
            starts.append(starts[-1] + len(idx))
        return LoRABatch(self, list(groups), starts, to_device(perm, torch.int64, device),
                         max(len(idx) for idx in groups.values()), row_slots)


class LoRABatch:
    """The adapters of one forward: its adapted tokens' flat indices grouped by slot (`perm`,
    segment s from `starts[s]`, adapter `slots[s]`): the layout of batonlm.kernels.lora."""

    def __init__(self, weights: LoRAWeights, slots: list[int], starts: list[int], perm: torch.Tensor,
                 max_segment: int, row_slots: list[int]) -> None:
        self.weights, self.slots, self.starts, self.perm, self.max_segment = weights, slots, starts, perm, max_segment
        self.row_slots = row_slots  # each row's slot (a decode batch's: each token's; the graph steps')
        self._device_segments: tuple[torch.Tensor, torch.Tensor] | None = None

    def add(self, out: torch.Tensor, layer: int, fused: str, x: torch.Tensor) -> torch.Tensor:
        """`out` (a fused projection's output for the tokens `x`) plus each token's adapter delta:
        the Triton kernels on a GPU, one shrink and one expand matmul per adapter elsewhere."""
        a, b = self.weights.a[layer, fused], self.weights.b[layer, fused]
        if not out.is_cuda:
            return lora_delta_reference(out, x, a, b, self.perm, self.slots, self.starts)
        if self._device_segments is None:
            self._device_segments = (to_device(self.slots, torch.int64, out.device),
                                     to_device(self.starts, torch.int64, out.device))
        return lora_delta_triton(out, x, a, b, self.perm, *self._device_segments, self.max_segment)


class RowSlotLoRA:
    """The LoRA deltas of a batch with fixed shapes, for the graph-backed decode steps (the
    compiled CPU step, CUDA graphs), whose inputs cannot decide which matmuls run: each token is
    shrunk by every slot's A at once, the products of the slots other than its own (`row_slots`,
    one per token; slot 0 is the base model's zeros) are zeroed, and one matmul by every slot's
    B (`LoRAWeights.b_all`) expands the rest. That is `slots` times one adapter's work, with no
    gather and nothing that depends on which adapters the batch holds; a token's delta is the
    one `LoRABatch.add` gives it, summed with exact zeros."""

    def __init__(self, weights: LoRAWeights, row_slots: torch.Tensor) -> None:
        self.weights = weights
        slots = torch.arange(weights.slots, device=row_slots.device)
        self.keep = (row_slots[:, None] == slots[None, :])[:, :, None]  # [T, slots, 1]

    def add(self, out: torch.Tensor, layer: int, fused: str, x: torch.Tensor) -> torch.Tensor:
        a, b_all = self.weights.a[layer, fused], self.weights.b_all[layer, fused]
        slots, rank, fan_in = a.shape
        shrunk = (x @ a.reshape(slots * rank, fan_in).T).view(-1, slots, rank)
        shrunk = torch.where(self.keep, shrunk, torch.zeros((), dtype=shrunk.dtype, device=shrunk.device))
        return out + shrunk.reshape(-1, slots * rank) @ b_all.T
