"""LoRA adapters (PEFT checkpoints) applied per token, many in one batch.

Every adapter is loaded at start into a slot (slot 0 is the base model: no delta). For each
layer and each fused projection of the decoder (`qkv`: q/k/v; `o`; `gate_up`: gate/up; `down`)
the slots' weights are stacked: A [slots, R, in] and B [slots, out, R], R the largest rank
(smaller ranks zero-padded), B already scaled (lora_alpha / r, or / sqrt(r) with rsLoRA), and a
fused projection's parts stacked along R with B block-diagonal, so that one pair of matmuls
gives the delta of the whole fused output. A forward's tokens are grouped by slot once
(`LoRABatch`): per projection the work is one shrink and one expand matmul per adapter in the
batch, never a loop over requests.

The reference is PEFT: `x @ W.T + scale * (x @ A.T) @ B.T` for each adapted module.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from batonlm.model_runner.model_config import ModelConfig

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


class LoRAWeights:
    """Every adapter's weights, stacked per layer and fused projection (slot 0: the base model)."""

    def __init__(self, adapters: list[AdapterSpec], cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                 sizes: dict[str, tuple[int, tuple[int, ...]]]) -> None:
        """`sizes`: per fused projection, (its input features, each part's output features)."""
        self.adapters = adapters
        self.slots = len(adapters) + 1
        self.rank = max(a.rank for a in adapters)
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.b: dict[tuple[int, str], torch.Tensor] = {}
        for layer in range(cfg.num_layers):
            for fused, parts in FUSED.items():
                fan_in, outs = sizes[fused]
                n = len(parts)
                self.a[layer, fused] = torch.zeros(self.slots, n * self.rank, fan_in, dtype=dtype, device=device)
                self.b[layer, fused] = torch.zeros(self.slots, sum(outs), n * self.rank, dtype=dtype, device=device)
        for slot, adapter in enumerate(adapters, start=1):
            self._load(slot, adapter, cfg, sizes)

    def _load(self, slot: int, adapter: AdapterSpec, cfg: ModelConfig, sizes: dict[str, tuple[int, tuple[int, ...]]]) -> None:
        r = self.rank
        seen: set[str] = set()
        with safe_open(str(Path(adapter.path) / "adapter_model.safetensors"), framework="pt") as sf:
            names = set(sf.keys())
            for layer in range(cfg.num_layers):
                for fused, parts in FUSED.items():
                    _, outs = sizes[fused]
                    for k, part in enumerate(parts):
                        if part not in adapter.targets:
                            continue
                        group = "self_attn" if fused in ("qkv", "o") else "mlp"
                        prefix = f"base_model.model.model.layers.{layer}.{group}.{part}"
                        a_name, b_name = f"{prefix}.lora_A.weight", f"{prefix}.lora_B.weight"
                        if a_name not in names or b_name not in names:
                            raise LoRAError(f"LoRA adapter {adapter.name!r}: {prefix} is a target module but "
                                            "its lora_A / lora_B weights are missing")
                        a, b = sf.get_tensor(a_name), sf.get_tensor(b_name)
                        row = sum(outs[:k])
                        if a.shape != (adapter.rank, self.a[layer, fused].shape[2]) or b.shape != (outs[k], adapter.rank):
                            raise LoRAError(f"LoRA adapter {adapter.name!r}: {prefix} has shapes A {tuple(a.shape)}, "
                                            f"B {tuple(b.shape)}, which do not fit the model")
                        self.a[layer, fused][slot, k * r : k * r + adapter.rank] = a
                        self.b[layer, fused][slot, row : row + outs[k], k * r : k * r + adapter.rank] = b * adapter.scale
                        seen.update((a_name, b_name))
        extra = sorted(n for n in names - seen if ".lora_" in n)
        if extra:
            raise LoRAError(f"LoRA adapter {adapter.name!r}: weights of modules batonlm does not adapt: {extra[:4]}")

    def batch(self, token_slots: list[int], device: torch.device) -> LoRABatch | None:
        """A forward's tokens grouped by adapter slot (None: every token on the base model)."""
        groups: dict[int, list[int]] = {}
        for t, s in enumerate(token_slots):
            if s:
                groups.setdefault(s, []).append(t)
        if not groups:
            return None
        from batonlm.model_runner.host_to_device import to_device

        return LoRABatch(self, [(s, to_device(idx, torch.int64, device)) for s, idx in groups.items()])


class LoRABatch:
    """The adapters of one forward: (slot, its tokens' flat indices)."""

    def __init__(self, weights: LoRAWeights, groups: list[tuple[int, torch.Tensor]]) -> None:
        self.weights, self.groups = weights, groups

    def add(self, out: torch.Tensor, layer: int, fused: str, x: torch.Tensor) -> torch.Tensor:
        """`out` (a fused projection's output for the tokens `x`) plus each token's adapter delta."""
        a, b = self.weights.a[layer, fused], self.weights.b[layer, fused]
        for slot, idx in self.groups:
            xs = x.index_select(0, idx)
            out.index_add_(0, idx, (xs @ a[slot].T) @ b[slot].T)
        return out
