"""A MoE layer's experts kept quantized (where resident.py keeps the projections): every expert
in FP8 (blocks, or per channel or tensor with dynamic or static activations, or online FP8)
becomes one `Fp8Experts`, every expert in W8A8 int8 per channel (dynamic or static activations)
one `Int8Experts`, every expert in int4 with consecutive
groups (GPTQ, AWQ, compressed-tensors W4A16, bitsandbytes 4-bit with its codebook) one `Int4Experts` (model_runner/moe.py), swapped in
on the meta device before the model is allocated and filled here with each expert's own codes and scales. A rank holds every expert's rows of its
gate/up and columns of its down projection (as the float loader's `weight_targets` say); a slice
that would split an FP8 block or an int4 group is refused at start-up, naming the layer. Experts
in other formats stay float, filled by the dequantizing view.
"""

from __future__ import annotations

import logging

import torch

from batonlm.model_runner.checkpoint import Checkpoint
from batonlm.model_runner.models.base import CausalLM
from batonlm.model_runner.moe import Fp8Experts, FusedExperts, Int4Experts, Int8Experts
from batonlm.model_runner.quantization import nvfp4
from batonlm.model_runner.quantization.config import QuantConfig, QuantizationError
from batonlm.model_runner.quantization.dequantized import fp8_per_channel
from batonlm.model_runner.quantization.formats import QuantizedLinear, codebook_of, int_layout, int_weights
from batonlm.model_runner.quantization.layer_kinds import (
    PACKED_STORAGES,
    input_quant,
    int4_group,
    int8_per_channel,
    per_channel_scale,
    same_codebook,
    static_scale,
    stored_scales,
)
from batonlm.model_runner.quantization.resident import ResidentLayer, cdiv, channel_scales, fill_int4
from batonlm.model_runner.weight_loader import Target, checkpoint_name

logger = logging.getLogger(__name__)


def make_resident_experts(
    model: CausalLM, ckpt: Checkpoint, linears: dict[str, QuantizedLinear], config: QuantConfig,
    targets: dict[str, Target | list[Target]], fp8_experts: bool = True,
) -> list[ResidentLayer]:
    """Swap every MoE layer's `FusedExperts` whose checkpoint experts the kernels cover for its
    quantized experts (FP8 ones only where `fp8_experts`: not on a GPU whose Triton has no FP8,
    before compute capability 8.9, where they are dequantized); returns what
    `resident.load_resident` fills."""
    out: list[ResidentLayer] = []
    kept: list[str] = []
    for module_name, module in list(model.named_modules()):
        if not isinstance(module, FusedExperts):
            continue
        prefix = checkpoint_name(model, module_name)
        names = [f"{prefix}.{e}.{n}.weight" for e in range(module.w13.shape[0]) for n in model.expert_weight_names]
        if not any(n in linears for n in names):
            continue  # float experts (a checkpoint's `ignore`)
        sources = [(linears[n], t) for n in names if n in linears and isinstance(t := targets.get(n), Target)]
        quant = config.for_layers(module_name, [lin.prefix for lin, _ in sources])  # (the experts share their inputs)
        layer = None
        awq = any(f"{lin.prefix}.pre_quant_scale" in lin.members for lin, _ in sources)  # (dequantized: folded in)
        if awq and quant.act_quant != "none":
            raise QuantizationError(f"{module_name}: experts with AWQ's pre_quant_scale before quantized inputs "
                                    "(NVFP4_AWQ) are not supported; their dense projections are")
        if len(sources) == len(names) and not awq:
            layer = ((_fp8_experts(ckpt, module_name, module, sources, quant) if fp8_experts else None)
                     or _int8_experts(ckpt, module_name, module, sources, quant)
                     or _int4_experts(ckpt, module_name, module, sources, quant))
        if layer is None:
            kept.append(module_name)
            continue
        parent, _, child = module_name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer.module)
        out.append(layer)
    if kept:
        # W8A8 experts run dequantized do not quantize their activations: not the checkpoint's outputs.
        w8a8 = config.act_quant != "none" and not config.online
        logger.log(logging.WARNING if w8a8 else logging.INFO,
                   "%d MoE layer(s) run their experts dequantized%s (formats the expert kernels do not cover: gate "
                   "and up in different activation orders, static and dynamic activations mixed, "
                   "other mixes), e.g. %s", len(kept), ", with unquantized activations" if w8a8 else "",
                   kept[0])
    return out


def _fp8_experts(
    ckpt: Checkpoint, module_name: str, module: FusedExperts, sources: list[tuple[QuantizedLinear, Target]],
    quant: QuantConfig,
) -> ResidentLayer | None:
    """`Fp8Experts` when every expert's projections are FP8 in blocks (an expert's intermediate
    size in whole blocks), or FP8 per channel (or tensor) with dynamic activations or every one
    with its static input scale, or online."""
    storages = {lin.storage for lin, _ in sources}
    statics = {static_scale(lin) for lin, _ in sources}
    channel = storages == {"online"} or (storages == {"fp8"} and quant.block is None and len(statics) == 1 and all(
        per_channel_scale(ckpt, lin) for lin, _ in sources))
    if not channel and not (storages == {"fp8"} and quant.block is not None and statics == {False}):
        return None
    bn, bk = quant.block if not channel and quant.block is not None else (1, 1)
    start, count = module.rows
    if module.intermediate % bn:
        return None
    if start % bn or count % bn or start % bk or (count % bk and start + count != module.intermediate):
        raise QuantizationError(f"{module_name}: this rank's intermediate features [{start}, {start + count}) of "
                                f"each expert would split its FP8 {bn}x{bk} blocks; a --tp that divides them into "
                                "whole blocks is needed")
    if quant.act_amax_ub is not None:
        raise QuantizationError(f"{module_name}: fbgemm_fp8 MoE experts (their activations' capped amax) are not "
                                "supported; fbgemm_fp8 runs dense projections")
    with torch.device("meta"):
        layer = Fp8Experts(module, None if channel else quant.block, static=statics == {True})
    return ResidentLayer(module_name, layer, sources, _fill_fp8)


def _int8_experts(
    ckpt: Checkpoint, module_name: str, module: FusedExperts, sources: list[tuple[QuantizedLinear, Target]],
    quant: QuantConfig,
) -> ResidentLayer | None:
    """`Int8Experts` when every expert's projections are int8 per channel with symmetric int8
    activations, per token or every one by its static input scale."""
    if quant.act_quant != "int8" or not quant.act_symmetric or {lin.storage for lin, _ in sources} != {"int"}:
        return None
    statics = {static_scale(lin) for lin, _ in sources}
    if len(statics) != 1 or not all(int8_per_channel(ckpt, lin) for lin, _ in sources):
        return None
    with torch.device("meta"):
        layer = Int8Experts(module, static=statics == {True})
    return ResidentLayer(module_name, layer, sources, _fill_int8)


def _int4_experts(
    ckpt: Checkpoint, module_name: str, module: FusedExperts, sources: list[tuple[QuantizedLinear, Target]],
    quant: QuantConfig,
) -> ResidentLayer | None:
    """`Int4Experts` when every expert's projections are 4-bit with consecutive groups of one
    size (a rank's slice of the down projections' rows in whole groups, or a start-up error), or
    in activation order (each expert's gate and up in one order, as GPTQ orders them)."""
    storages = {lin.storage for lin, _ in sources}
    if not storages <= PACKED_STORAGES - {"moint4"}:
        return None
    books = [codebook_of(ckpt, lin) for lin, _ in sources]
    if not same_codebook(books):
        return None
    by_expert: dict[tuple[int, int], list[tuple[QuantizedLinear, Target]]] = {}
    for lin, t in sources:  # (expert, 0: gate and up / 1: down) -> its layers
        by_expert.setdefault((_expert(lin), t.dim), []).append((lin, t))
    groups = {int4_group(ckpt, module_name, part, quant) for part in by_expert.values()}
    if len(groups) != 1 or None in groups:
        return None
    group = groups.pop()
    assert group is not None
    order_groups = (0, 0)
    if group == 0:  # activation order: every group of each projection (any row may be in any)
        gate = next(lin for lin, t in sources if t.dim == 0)
        down = next(lin for lin, t in sources if t.dim == 1)
        order_groups = (int_layout(ckpt, gate, quant)[2], int_layout(ckpt, down, quant)[2])
    bits = int_layout(ckpt, sources[0][0], quant)[0]
    fp4_input = nvfp4.layout(sources[0][0].members) if quant.act_quant == "fp4" else ""
    fake_input = input_quant(quant, storages, any(static_scale(lin) for lin, _ in sources), module_name)
    stored, divides = stored_scales(ckpt, sources)
    with torch.device("meta"):
        layer = Int4Experts(module, group, order_groups, bits, codebook=books[0] is not None, fp4_input=fp4_input,
                            stored_scales=stored, scale_2_divides=divides, input_quant=fake_input)
    return ResidentLayer(module_name, layer, sources, _fill_int4)


def _expert(lin: QuantizedLinear) -> int:
    """The expert of a checkpoint layer `<experts>.<e>.<name>`."""
    return int(lin.prefix.rsplit(".", 2)[-2])


def _fill_fp8(module: Fp8Experts, ckpt: Checkpoint, lin: QuantizedLinear, t: Target, quant: QuantConfig) -> None:
    """One expert's gate or up rows (w13, at the target's offset) or down columns (w2): this
    rank's whole blocks of its codes and scales, or its rows' channel scales."""
    if module.block is None:
        if lin.storage == "online":
            w, scale = fp8_per_channel(ckpt.get(lin.members[0]))
        else:
            w, scale = ckpt.get(f"{lin.prefix}.weight").to(torch.float8_e4m3fn), channel_scales(ckpt, lin)
        _fill_channels(module, _expert(lin), w, scale, t)
        _fill_input_scale(module, ckpt, lin, t)
        return
    e, device = _expert(lin), module.w13_q.device
    bn, bk = module.block
    w = ckpt.get(f"{lin.prefix}.weight").to(torch.float8_e4m3fn)
    scale = ckpt.get(lin.members[1]).to(torch.float32)
    if t.dim == 0:
        module.w13_q[e, t.offset : t.offset + t.count] = w[t.start : t.start + t.count].to(device)
        module.w13_scale[e, t.offset // bn : (t.offset + t.count) // bn] = scale[
            t.start // bn : (t.start + t.count) // bn].to(device)
    else:
        module.w2_q[e] = w[:, t.start : t.start + t.count].to(device)
        module.w2_scale[e] = scale[:, t.start // bk : cdiv(t.start + t.count, bk)].to(device)


def _fill_int8(module: Int8Experts, ckpt: Checkpoint, lin: QuantizedLinear, t: Target, quant: QuantConfig) -> None:
    _fill_channels(module, _expert(lin), ckpt.get(f"{lin.prefix}.weight"), channel_scales(ckpt, lin), t)
    _fill_input_scale(module, ckpt, lin, t)


def _fill_input_scale(module: Fp8Experts | Int8Experts, ckpt: Checkpoint, lin: QuantizedLinear, t: Target) -> None:
    """An expert's static activation scale: its down projection's, or for its fused gate and up
    the larger of theirs (calibrated on the same input they are equal; the larger clips nothing),
    every rank the whole layer's."""
    if module.w13_input_scale is None or module.w2_input_scale is None:
        return
    e, given = _expert(lin), ckpt.get(f"{lin.prefix}.input_scale").to(torch.float32).reshape(())
    if t.dim == 1:
        module.w2_input_scale[e] = given
    else:  # the gate (offset 0) fills first
        module.w13_input_scale[e] = given if t.offset == 0 else torch.maximum(module.w13_input_scale[e], given)


def _fill_channels(module: Fp8Experts | Int8Experts, e: int, w: torch.Tensor, scale: torch.Tensor, t: Target) -> None:
    """Expert e's gate or up rows (w13's, at the target's offset) with their channel scales, or its
    down projection's columns (w2's) with all its channel scales, from codes `w` and `scale` [N]."""
    device = module.w13_q.device
    if t.dim == 0:
        module.w13_q[e, t.offset : t.offset + t.count] = w[t.start : t.start + t.count].to(device)
        module.w13_scale[e, t.offset : t.offset + t.count] = scale[t.start : t.start + t.count].to(device)
    else:
        module.w2_q[e] = w[:, t.start : t.start + t.count].to(device)
        module.w2_scale[e] = scale.to(device)


def _fill_int4(module: Int4Experts, ckpt: Checkpoint, lin: QuantizedLinear, t: Target, quant: QuantConfig) -> None:
    """One expert's gate or up output columns (w13's, at the target's offset) or its down
    projection's input rows (w2's, whole groups)."""
    e = _expert(lin)
    name = "w13" if t.dim == 0 else "w2"
    zeros = getattr(module, f"{name}_zeros")
    qweight, scales = (getattr(module, f"{name}_{part}")[e] for part in ("qweight", "scales"))
    iw = int_weights(ckpt, lin, quant)
    scale_2 = getattr(module, f"{name}_scale_2")
    fill_int4(qweight, None if zeros is None else zeros[e], scales, module.group, iw, t,
              None if scale_2 is None else scale_2[e])
    if module.codebook is not None and iw.codebook is not None:  # (one for every expert: _int4_experts checked)
        module.codebook.copy_(iw.codebook)
    g_idx = getattr(module, f"{name}_g_idx")
    if g_idx is not None:  # activation order: this rank's rows' groups (gate and up share them)
        g_idx[e] = iw.groups[t.start : t.start + t.count] if t.dim == 1 else iw.groups
    input_scale = getattr(module, f"{name}_input_scale")
    if input_scale is not None:  # NVFP4 W4A4: the expert's own, every rank the whole layer's
        _fill_fp4_input_scale(input_scale, ckpt, lin, t, e)


def _fill_fp4_input_scale(input_scale: torch.Tensor, ckpt: Checkpoint, lin: QuantizedLinear, t: Target, e: int) -> None:
    """Expert e's FP4 activation scale: its down projection's, or its gate's and up's, which
    quantize one input and so must agree (calibrated on it, they do), else a start-up error."""
    given = nvfp4.input_scale(ckpt, lin.prefix, lin.members)
    if t.dim == 0 and t.offset != 0 and not torch.equal(input_scale[e].cpu(), given):  # (the gate fills first)
        raise QuantizationError(f"{lin.prefix}: its {nvfp4.input_scale_name(lin.members)} {float(given)} differs from its gate's "
                                f"{float(input_scale[e])}; one expert's gate and up quantize one input with one scale")
    input_scale[e] = given
