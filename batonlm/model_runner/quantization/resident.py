"""Quantized weights kept quantized on the device (CUDA by default, W8A8 everywhere): each
decoder projection whose checkpoint layers are all FP8, all int8 per channel with int8
activations (W8A8-int8), or all 4-bit with consecutive groups, becomes an `Fp8Linear` /
`Int8Linear` / `Int4Linear` (quantization/linear.py) before the model's memory is allocated, and
is filled here from the checkpoint's own integers and scales: never through a float copy.

A projection the kernels do not cover (weight-only int8, int8 per group or with zeros,
activation-ordered groups, mixed formats) stays a float layer filled by the dequantizing view. Under tensor parallelism a rank holds the rows or
columns of every source layer the float loader would give it (`weight_targets`); a slice that
would split an FP8 block or an int4 group is refused at start-up, naming the layer.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from torch import nn

from batonlm.kernels.quant import pack_int4
from batonlm.model_runner.checkpoint import Checkpoint
from batonlm.model_runner.models.base import CausalLM
from batonlm.model_runner.moe import Fp8Experts, FusedExperts
from batonlm.model_runner.parallel_layers import RowParallelLinear
from batonlm.model_runner.quantization.config import QuantConfig, QuantizationError
from batonlm.model_runner.quantization.dequantized import fp8_per_channel
from batonlm.model_runner.quantization.formats import QuantizedLinear, int_weights
from batonlm.model_runner.quantization.linear import Fp8Linear, Int4Linear, Int8Linear
from batonlm.model_runner.weight_loader import Target, checkpoint_name

logger = logging.getLogger(__name__)


@dataclass
class ResidentLayer:
    """A projection made quantized: its module and the checkpoint layers that fill it."""

    name: str  # the model's module name (e.g. model.layers.0.self_attn.qkv_proj)
    module: Fp8Linear | Int8Linear | Int4Linear | Fp8Experts
    sources: list[tuple[QuantizedLinear, Target]]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_resident(
    model: CausalLM, ckpt: Checkpoint, linears: dict[str, QuantizedLinear], quant: QuantConfig,
    targets: dict[str, Target | list[Target]], dtype: torch.dtype,
) -> list[ResidentLayer]:
    """Swap every decoder projection of `model` (on the meta device, not allocated yet) that can
    stay quantized for its quantized layer; `targets`: the float loader's, computed before the
    swap. Returns what `load_resident` fills."""
    by_param: dict[int, list[tuple[str, Target]]] = {}
    for name, found in targets.items():
        for t in found if isinstance(found, list) else [found]:
            by_param.setdefault(id(t.param), []).append((name, t))
    out: list[ResidentLayer] = []
    kept: set[str] = set()
    for module_name, module in list(model.named_modules()):
        if ".layers." not in module_name or not isinstance(module, (nn.Linear, RowParallelLinear)):
            continue
        weight = module.weight
        sources = [(linears[n], t) for n, t in by_param.get(id(weight), []) if n in linears]
        if not sources or len(sources) != len(by_param.get(id(weight), [])):
            continue
        n, k = weight.shape
        storages = {lin.storage for lin, _ in sources}
        layer: Fp8Linear | Int8Linear | Int4Linear
        static = any(_static(lin) for lin, _ in sources)
        if storages == {"fp8"}:
            block = quant.block
            for lin, t in sources:
                _check_fp8_slice(module_name, lin, t, block)
            with torch.device("meta"):
                layer = Fp8Linear(n, k, block, static, bias=False)
        elif storages == {"int"} and quant.act_quant == "int8" and all(_int8_per_channel(ckpt, lin) for lin, _ in sources):
            with torch.device("meta"):
                layer = Int8Linear(n, k, static, bias=False)
        elif storages == {"online"}:  # --quantization fp8 on a float checkpoint: per channel, W8A8 dynamic
            with torch.device("meta"):
                layer = Fp8Linear(n, k, None, static=False, bias=False)
        elif storages <= {"gptq", "awq", "packed"}:
            group = _int4_group(ckpt, module_name, sources, quant)
            if group is None:
                kept.add(module_name)
                continue
            with torch.device("meta"):
                layer = Int4Linear(n, k, group, dtype, bias=False)
        else:
            kept.add(module_name)
            continue
        _swap(model, module_name, module, layer, dtype)
        out.append(ResidentLayer(module_name, layer, sources))
    for module_name, module in list(model.named_modules()):
        if isinstance(module, FusedExperts):
            experts = _fp8_experts(model, ckpt, module_name, module, linears, targets, quant)
            if experts is None:
                kept.add(module_name)
            else:
                parent, _, child = module_name.rpartition(".")
                setattr(model.get_submodule(parent), child, experts.module)
                out.append(experts)
    if kept:
        logger.info("%d quantized projection(s) run dequantized (weight-only int8, int8 per group or with zeros, "
                    "activation-ordered groups, experts not in FP8 blocks or mixed formats), "
                    "e.g. %s", len(kept), sorted(kept)[0])
    return out


def _fp8_experts(
    model: CausalLM, ckpt: Checkpoint, module_name: str, module: FusedExperts, linears: dict[str, QuantizedLinear],
    targets: dict[str, Target | list[Target]], quant: QuantConfig,
) -> ResidentLayer | None:
    """The experts as `Fp8Experts` when every expert's gate, up and down projections are FP8 in
    blocks, with an expert's intermediate size in whole blocks, or FP8 per channel (or tensor)
    with dynamic activations, or online FP8 (else None: dequantized). A rank's slice that would
    split a block is refused."""
    prefix = checkpoint_name(model, module_name)
    names = [f"{prefix}.{e}.{n}.weight" for e in range(module.w13.shape[0]) for n in model.expert_weight_names]
    if not all(n in linears and isinstance(targets.get(n), Target) for n in names):
        return None
    storages = {linears[n].storage for n in names}
    channel = storages == {"online"} or (storages == {"fp8"} and quant.block is None and all(
        _per_channel_scale(ckpt, linears[n]) and not _static(linears[n]) for n in names))
    if not channel and not (storages == {"fp8"} and quant.block is not None):
        return None
    bn, bk = quant.block if not channel and quant.block is not None else (1, 1)
    start, count = module.rows
    if module.intermediate % bn:
        return None
    if start % bn or count % bn or start % bk or (count % bk and start + count != module.intermediate):
        raise QuantizationError(f"{module_name}: this rank's intermediate features [{start}, {start + count}) of "
                                f"each expert would split its FP8 {bn}x{bk} blocks; a --tp that divides them into "
                                "whole blocks is needed")
    with torch.device("meta"):
        layer = Fp8Experts(module, None if channel else quant.block)
    sources = []
    for n in names:
        t = targets[n]
        assert isinstance(t, Target)
        sources.append((linears[n], t))
    return ResidentLayer(module_name, layer, sources)


def _per_channel_scale(ckpt: Checkpoint, lin: QuantizedLinear) -> bool:
    """The layer's weight scale is one per output channel, or one per tensor."""
    n = lin.shape[0]
    scale = Checkpoint.shape(ckpt, lin.members[1])
    return math.prod(scale) == 1 or tuple(scale) in ((n,), (n, 1))


def _static(lin: QuantizedLinear) -> bool:
    return any(m.endswith(".input_scale") for m in lin.members)


def _int8_per_channel(ckpt: Checkpoint, lin: QuantizedLinear) -> bool:
    """An int8 layer the W8A8-int8 kernels run: signed codes, no zeros, a scale per output
    channel or per tensor."""
    return (Checkpoint.dtype(ckpt, f"{lin.prefix}.weight") == "I8" and f"{lin.prefix}.weight_zero_point" not in lin.members
            and _per_channel_scale(ckpt, lin))


def _int4_group(
    ckpt: Checkpoint, module_name: str, sources: list[tuple[QuantizedLinear, Target]], quant: QuantConfig
) -> int | None:
    """The group size the int4 layout takes (-1: one group), or None: not 4-bit with
    consecutive groups. A slice that would split a group is refused."""
    sizes = set()
    for lin, t in sources:
        iw = int_weights(ckpt, lin, quant)
        size = iw.group_size
        if iw.bits != 4 or size is None:
            return None
        size = -1 if iw.scales.shape[0] == 1 else size
        if t.dim == 1 and size != -1 and (t.start % size or (t.count % size and t.start + t.count != t.full)):
            raise QuantizationError(f"{module_name}: this rank's input features [{t.start}, {t.start + t.count}) of "
                                    f"{lin.prefix} would split its int4 groups of {size}; choose a --tp that "
                                    "divides them into whole groups")
        sizes.add(size)
    if len(sizes) != 1:
        raise QuantizationError(f"{module_name}: its checkpoint layers have different group sizes {sorted(sizes)}")
    return sizes.pop()


def _check_fp8_slice(module_name: str, lin: QuantizedLinear, t: Target, block: tuple[int, int] | None) -> None:
    if block is None:
        return
    size = block[t.dim]
    full = t.full if t.full is not None else t.count
    whole = t.start % size == 0 and (t.count % size == 0 or t.start + t.count == full)
    fused = t.dim == 1 or t.offset % block[0] == 0
    if not (whole and fused):
        what = "output rows" if t.dim == 0 else "input columns"
        raise QuantizationError(f"{module_name}: {lin.prefix}'s {what} [{t.start}, {t.start + t.count}) at offset "
                                f"{t.offset} would split its FP8 {block[0]}x{block[1]} blocks; a --tp that divides "
                                "them into whole blocks is needed")


def _swap(model: nn.Module, name: str, old: nn.Module, new: Fp8Linear | Int8Linear | Int4Linear,
          dtype: torch.dtype) -> None:
    if isinstance(old, RowParallelLinear):  # its bias stays, added once after the ranks' sum
        del old.weight
        old.local = new
        return
    if old.bias is not None:
        new.bias = nn.Parameter(torch.empty(new.n, dtype=dtype, device="meta"))
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, new)


def load_resident(layers: list[ResidentLayer], ckpt: Checkpoint, quant: QuantConfig) -> None:
    """Fill each quantized layer from its checkpoint layers' integers and scales (this rank's
    rows or columns of each, at its offset among a fused projection's)."""
    with torch.no_grad():
        for layer in layers:
            for lin, t in layer.sources:
                if isinstance(layer.module, Fp8Experts):
                    _load_fp8_expert(layer.module, ckpt, lin, t)
                elif isinstance(layer.module, Fp8Linear) and lin.storage == "online":
                    _load_online_fp8(layer.module, ckpt, lin, t)
                elif isinstance(layer.module, Fp8Linear):
                    _load_fp8(layer.module, ckpt, lin, t, quant)
                elif isinstance(layer.module, Int8Linear):
                    _load_int8(layer.module, ckpt, lin, t)
                else:
                    _load_int4(layer.module, ckpt, lin, t, quant)


def _narrow(x: torch.Tensor, t: Target, dim: int | None = None) -> torch.Tensor:
    return x if t.full is None else x.narrow(t.dim if dim is None else dim, t.start, t.count)


def _load_fp8(module: Fp8Linear, ckpt: Checkpoint, lin: QuantizedLinear, t: Target, quant: QuantConfig) -> None:
    p = f"{lin.prefix}."
    w = _narrow(ckpt.get(p + "weight"), t).to(torch.float8_e4m3fn)
    rows = slice(t.offset, t.offset + t.count) if t.dim == 0 else slice(None)
    module.weight_q[rows] = w.to(module.weight_q.device)
    if module.block is not None:
        bn, bk = module.block
        scale = ckpt.get(lin.members[1]).to(torch.float32)
        if t.dim == 0:
            s = scale[t.start // bn : _cdiv(t.start + t.count, bn)]
            module.weight_scale[t.offset // bn : t.offset // bn + s.shape[0]] = s
        else:
            module.weight_scale.copy_(scale[:, t.start // bk : _cdiv(t.start + t.count, bk)])
    else:
        _load_channel_scales(module, ckpt, lin, t)
    _load_input_scale(module, ckpt, lin, t)


def _load_fp8_expert(module: Fp8Experts, ckpt: Checkpoint, lin: QuantizedLinear, t: Target) -> None:
    """One expert's gate or up rows (w13, at the target's offset) or down columns (w2): this
    rank's whole blocks of its codes and scales, or its rows' channel scales. The expert:
    `<experts>.<e>.<name>`."""
    e = int(lin.prefix.rsplit(".", 2)[-2])
    device = module.w13_q.device
    if module.block is None:
        if lin.storage == "online":
            w, scale = fp8_per_channel(ckpt.get(lin.members[0]))
        else:
            w = ckpt.get(f"{lin.prefix}.weight").to(torch.float8_e4m3fn)
            scale = ckpt.get(lin.members[1]).to(torch.float32).reshape(-1).expand(lin.shape[0])
        if t.dim == 0:
            module.w13_q[e, t.offset : t.offset + t.count] = w[t.start : t.start + t.count].to(device)
            module.w13_scale[e, t.offset : t.offset + t.count] = scale[t.start : t.start + t.count].to(device)
        else:
            module.w2_q[e] = w[:, t.start : t.start + t.count].to(device)
            module.w2_scale[e] = scale.to(device)
        return
    bn, bk = module.block
    w = ckpt.get(f"{lin.prefix}.weight").to(torch.float8_e4m3fn)
    scale = ckpt.get(lin.members[1]).to(torch.float32)
    if t.dim == 0:
        module.w13_q[e, t.offset : t.offset + t.count] = w[t.start : t.start + t.count].to(device)
        module.w13_scale[e, t.offset // bn : (t.offset + t.count) // bn] = scale[
            t.start // bn : (t.start + t.count) // bn].to(device)
    else:
        module.w2_q[e] = w[:, t.start : t.start + t.count].to(device)
        module.w2_scale[e] = scale[:, t.start // bk : _cdiv(t.start + t.count, bk)].to(device)


def _load_online_fp8(module: Fp8Linear, ckpt: Checkpoint, lin: QuantizedLinear, t: Target) -> None:
    """A float weight rounded per channel (over its whole rows, so every rank's columns share the
    one-rank scales), this rank's part of the codes and scales."""
    q, scale = fp8_per_channel(ckpt.get(lin.members[0]))
    rows = slice(t.offset, t.offset + t.count) if t.dim == 0 else slice(None)
    module.weight_q[rows] = _narrow(q, t).to(module.weight_q.device)
    module.weight_scale[rows] = scale[t.start : t.start + t.count] if t.dim == 0 else scale


def _load_int8(module: Int8Linear, ckpt: Checkpoint, lin: QuantizedLinear, t: Target) -> None:
    rows = slice(t.offset, t.offset + t.count) if t.dim == 0 else slice(None)
    module.weight_q[rows] = _narrow(ckpt.get(f"{lin.prefix}.weight"), t).to(module.weight_q.device)
    _load_channel_scales(module, ckpt, lin, t)
    _load_input_scale(module, ckpt, lin, t)


def _load_channel_scales(module: Fp8Linear | Int8Linear, ckpt: Checkpoint, lin: QuantizedLinear, t: Target) -> None:
    """A per-channel (or per-tensor) weight scale: this rank's output rows of it, at their offset."""
    scale = ckpt.get(lin.members[1]).to(torch.float32)
    full = lin.shape[0]
    per_channel = scale.reshape(-1).expand(full) if scale.numel() == 1 else scale.reshape(full)
    rows = slice(t.offset, t.offset + t.count) if t.dim == 0 else slice(None)
    module.weight_scale[rows] = per_channel[t.start : t.start + t.count] if t.dim == 0 else per_channel


def _load_input_scale(module: Fp8Linear | Int8Linear, ckpt: Checkpoint, lin: QuantizedLinear, t: Target) -> None:
    """A static activation scale; one for a fused input: the largest of its layers' (nothing clips)."""
    name = f"{lin.prefix}.input_scale"
    if module.input_scale is not None and name in lin.members:
        given = ckpt.get(name).to(torch.float32).reshape(1)
        module.input_scale.copy_(given if t.offset == 0 else torch.maximum(module.input_scale, given))


def _load_int4(module: Int4Linear, ckpt: Checkpoint, lin: QuantizedLinear, t: Target, quant: QuantConfig) -> None:
    iw = int_weights(ckpt, lin, quant)
    q, zeros, scales = iw.q, iw.zeros, iw.scales  # [K, N], [G, N], [G, N]
    if t.dim == 0:  # this rank's output columns of W^T, at its offset in the fused layer
        cols = slice(t.offset, t.offset + t.count)
        q, zeros, scales = (_narrow(x, t, dim=1) for x in (q, zeros, scales))
    else:  # this rank's input rows, in whole groups
        cols = slice(None)
        q = _narrow(q, t, dim=0)
        if module.group_size != -1 and t.full is not None:
            g = slice(t.start // module.group_size, _cdiv(t.start + t.count, module.group_size))
            zeros, scales = zeros[g], scales[g]
    device = module.qweight.device
    module.qweight[:, cols] = pack_int4(q).to(device)
    module.zeros[:, cols] = zeros.to(device=device, dtype=module.zeros.dtype)
    module.scales[:, cols] = scales.to(device=device, dtype=module.scales.dtype)
