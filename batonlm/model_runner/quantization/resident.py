"""Quantized weights kept quantized on the device (CUDA by default, W8A8 everywhere): each
decoder projection whose checkpoint layers are all FP8, all int8 per channel with int8
activations (W8A8-int8), all bitsandbytes 8-bit (LLM.int8: `LlmInt8Linear`), or all 4- or 8-bit with consecutive groups (bitsandbytes 4-bit with
its codebook too), becomes an `Fp8Linear` /
`Int8Linear` / `PackedIntLinear` (quantization/linear.py) before the model's memory is allocated, and
is filled here from the checkpoint's own integers and scales: never through a float copy.

Weight-only integer layers, 4- or 8-bit (GPTQ, AWQ, compressed-tensors packed, and unpacked
int8 whose activations are not int8), become one packed layout. A projection the kernels do not
cover (int8 scaled per block, fused layers in different activation orders or widths, mixed
formats) stays a float layer filled by the dequantizing view.
Under tensor parallelism a rank holds the rows or columns of every source layer the float loader
would give it (`weight_targets`); a slice that would split an FP8 block or an int4 group is
refused at start-up, naming the layer. A MoE layer's experts: resident_experts.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from batonlm.kernels.int4 import pack_int4
from batonlm.kernels.int8 import QMAX, QMIN, per_token_quant_int8_asym_reference
from batonlm.kernels.quant import FBGEMM_MIN_SCALE
from batonlm.model_runner.checkpoint import Checkpoint
from batonlm.model_runner.models.base import CausalLM
from batonlm.model_runner.parallel_layers import RowParallelLinear
from batonlm.model_runner.quantization import nvfp4
from batonlm.model_runner.quantization.bnb import int8_weight
from batonlm.model_runner.quantization.config import QuantConfig, QuantizationError
from batonlm.model_runner.quantization.dequantized import fp8_per_channel
from batonlm.model_runner.quantization.formats import (
    QuantizedLinear,
    codebook_of,
    int_layout,
    int_weights,
)
from batonlm.model_runner.quantization.int_weights import IntWeights
from batonlm.model_runner.quantization.layer_kinds import (
    PACKED_STORAGES,
    input_quant,
    int4_group,
    int8_per_channel,
    pre_quant_scale,
    same_codebook,
    static_scale,
    stored_scales,
)
from batonlm.model_runner.quantization.linear import Fp8Linear, Int8Linear, LlmInt8Linear, PackedIntLinear
from batonlm.model_runner.weight_loader import Target

logger = logging.getLogger(__name__)


# Fills a layer's part of one checkpoint layer: (module, checkpoint, its layer, where, quant).
Fill = Callable[[Any, Checkpoint, QuantizedLinear, Target, QuantConfig], None]


@dataclass
class ResidentLayer:
    """A projection (or a MoE layer's experts) made quantized: its module, the checkpoint layers
    that fill it and how."""

    name: str  # the model's module name (e.g. model.layers.0.self_attn.qkv_proj)
    module: nn.Module  # Fp8Linear, Int8Linear, PackedIntLinear; Fp8Experts, Int4Experts (resident_experts.py)
    sources: list[tuple[QuantizedLinear, Target]]
    fill: Fill


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_resident(
    model: CausalLM, ckpt: Checkpoint, linears: dict[str, QuantizedLinear], config: QuantConfig,
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
        quant = config.for_layers(module_name, [lin.prefix for lin, _ in sources])  # (its inputs quantized or not)
        layer: Fp8Linear | Int8Linear | LlmInt8Linear | PackedIntLinear
        static = any(static_scale(lin) for lin, _ in sources)
        awq = pre_quant_scale(ckpt, module_name, sources) is not None
        if awq and not storages <= {"moint4", "nvfp4"}:
            kept.add(module_name)  # (AWQ's pre_quant_scale: folded into the dequantized weight)
            continue
        if storages == {"fp8"}:
            block = quant.block
            for lin, t in sources:
                _check_fp8_slice(module_name, lin, t, block)
            bounds = {"amax_ub": quant.act_amax_ub, "min_scale": FBGEMM_MIN_SCALE} if quant.act_amax_ub else {}
            with torch.device("meta"):
                layer = Fp8Linear(n, k, block, static, bias=False, **bounds)
        elif storages == {"int"} and quant.act_quant == "int8" and all(int8_per_channel(ckpt, lin) for lin, _ in sources):
            with torch.device("meta"):
                layer = Int8Linear(n, k, static, bias=False, asym=not quant.act_symmetric)
        elif storages == {"bnb8"}:  # bitsandbytes 8-bit: LLM.int8
            with torch.device("meta"):
                layer = LlmInt8Linear(n, k, quant.llm_int8_threshold, bias=False)
        elif storages == {"online"}:  # --quantization fp8 on a float checkpoint: per channel, W8A8 dynamic
            with torch.device("meta"):
                layer = Fp8Linear(n, k, None, static=False, bias=False)
        elif storages <= PACKED_STORAGES:
            group = int4_group(ckpt, module_name, sources, quant)  # 4 or 8 bits, weight-only or inputs quantized
            books = [codebook_of(ckpt, lin) for lin, _ in sources]
            w4a4 = quant.act_quant == "fp4" and storages == {"nvfp4"}
            fake_input = input_quant(quant, storages, static, module_name)
            if group is None or not same_codebook(books):
                if w4a4 or fake_input:  # dequantized, its activations would not be quantized
                    raise QuantizationError(f"{module_name}: its layers quantize their inputs "
                                            f"({'NVFP4' if w4a4 else fake_input}) but cannot be fused into one packed "
                                            "layer (different widths or groups); they run packed only")
                kept.add(module_name)
                continue
            bits, _, num_groups = int_layout(ckpt, sources[0][0], quant)
            fp4_input = nvfp4.layout(sources[0][0].members) if w4a4 else ""
            if fp4_input:
                _check_fp4_input_scales(ckpt, module_name, sources)
            # the FP4 formats' group scales kept as they store them (1 byte a group, not float32's 4)
            stored, divides = stored_scales(ckpt, sources)
            with torch.device("meta"):
                layer = PackedIntLinear(n, k, group, dtype, bias=False, groups=num_groups if group == 0 else 0,
                                        bits=bits, codebook=books[0] is not None, fp4_input=fp4_input,
                                        stored_scales=stored, scale_2_divides=divides, input_quant=fake_input,
                                        pre_quant_scale=awq)
        else:
            kept.add(module_name)
            continue
        _swap(model, module_name, module, layer, dtype)
        out.append(ResidentLayer(module_name, layer, sources, _fill_of(layer, storages)))
    if kept:
        logger.info("%d quantized projection(s) run dequantized (int8 scaled per block, fused layers in different "
                    "activation orders, widths or codebooks, bitsandbytes blocks across rows, mixed formats), e.g. %s",
                    len(kept), sorted(kept)[0])
    return out


def _check_fp4_input_scales(ckpt: Checkpoint, module_name: str, sources: list[tuple[QuantizedLinear, Target]]) -> None:
    """A fused NVFP4 W4A4 projection quantizes its one input once: its layers' calibrated input
    scales must agree (llm-compressor and ModelOpt calibrate q/k/v and gate/up on their one input)."""
    scales = [nvfp4.input_scale(ckpt, lin.prefix, lin.members) for lin, _ in sources]
    if any(not torch.equal(s, scales[0]) for s in scales):
        raise QuantizationError(f"{module_name}: its NVFP4 layers' {nvfp4.input_scale_name(sources[0][0].members)} differ "
                                f"({', '.join(str(float(s)) for s in scales)}); fused layers quantize one input "
                                "with one scale")


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


def _swap(model: nn.Module, name: str, old: nn.Module, new: Fp8Linear | Int8Linear | LlmInt8Linear | PackedIntLinear,
          dtype: torch.dtype) -> None:
    if isinstance(old, RowParallelLinear):  # its bias stays, added once after the ranks' sum
        del old.weight
        old.local = new
        return
    if old.bias is not None:
        new.bias = nn.Parameter(torch.empty(new.n, dtype=dtype, device="meta"))
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, new)


def _fill_of(layer: nn.Module, storages: set[str]) -> Fill:
    if isinstance(layer, Fp8Linear):
        return _load_online_fp8 if storages == {"online"} else _load_fp8
    if isinstance(layer, LlmInt8Linear):
        return _load_llm_int8
    return _load_int8 if isinstance(layer, Int8Linear) else _load_int4


def load_resident(layers: list[ResidentLayer], ckpt: Checkpoint, quant: QuantConfig) -> None:
    """Fill each quantized layer from its checkpoint layers' integers and scales (this rank's
    rows or columns of each, at its offset among a fused projection's)."""
    with torch.no_grad():
        for layer in layers:
            for lin, t in layer.sources:
                layer.fill(layer.module, ckpt, lin, t, quant)
            finish = getattr(layer.module, "finish_load", None)
            if finish is not None:  # what a layer derives from its whole checkpoint part
                finish()


def _narrow(x: torch.Tensor, t: Target, dim: int | None = None) -> torch.Tensor:
    return x if t.full is None else x.narrow(t.dim if dim is None else dim, t.start, t.count)


def _load_fp8(module: Fp8Linear, ckpt: Checkpoint, lin: QuantizedLinear, t: Target, quant: QuantConfig) -> None:
    w = ckpt.get(f"{lin.prefix}.weight").to(torch.float8_e4m3fn)
    if module.block is None:
        _fill_channel_scaled(module, w, channel_scales(ckpt, lin), t)
    else:
        rows = slice(t.offset, t.offset + t.count) if t.dim == 0 else slice(None)
        module.weight_q[rows] = _narrow(w, t).to(module.weight_q.device)
        bn, bk = module.block
        scale = ckpt.get(lin.members[1]).to(torch.float32)
        if t.dim == 0:
            s = scale[t.start // bn : cdiv(t.start + t.count, bn)]
            module.weight_scale[t.offset // bn : t.offset // bn + s.shape[0]] = s
        else:
            module.weight_scale.copy_(scale[:, t.start // bk : cdiv(t.start + t.count, bk)])
    _load_input_scale(module, ckpt, lin, t)


def _load_online_fp8(module: Fp8Linear, ckpt: Checkpoint, lin: QuantizedLinear, t: Target, quant: QuantConfig,
                     ) -> None:
    """A float weight rounded per channel (over its whole rows, so every rank's columns share the
    one-rank scales)."""
    _fill_channel_scaled(module, *fp8_per_channel(ckpt.get(lin.members[0])), t)


def _load_int8(module: Int8Linear, ckpt: Checkpoint, lin: QuantizedLinear, t: Target, quant: QuantConfig) -> None:
    _fill_channel_scaled(module, ckpt.get(f"{lin.prefix}.weight"), channel_scales(ckpt, lin), t)
    if module.input_zero_point is not None:
        _load_input_range(module, ckpt, lin, t)
    else:
        _load_input_scale(module, ckpt, lin, t)


def _load_llm_int8(module: LlmInt8Linear, ckpt: Checkpoint, lin: QuantizedLinear, t: Target, quant: QuantConfig,
                   ) -> None:
    _fill_channel_scaled(module, *int8_weight(ckpt, lin.prefix, lin.members), t)


def channel_scales(ckpt: Checkpoint, lin: QuantizedLinear) -> torch.Tensor:
    """A layer's weight scale, per channel or per tensor, as one float32 per output row [N]."""
    return ckpt.get(lin.members[1]).to(torch.float32).reshape(-1).expand(lin.shape[0])


def _fill_channel_scaled(module: Fp8Linear | Int8Linear | LlmInt8Linear, codes: torch.Tensor, scale: torch.Tensor,
                         t: Target) -> None:
    """This rank's part of a layer with one scale per output row (codes [N, K], scale [N]): its
    rows at the target's offset with their scales, or its columns with every scale."""
    rows = slice(t.offset, t.offset + t.count) if t.dim == 0 else slice(None)
    module.weight_q[rows] = _narrow(codes, t).to(module.weight_q.device)
    module.weight_scale[rows] = scale[t.start : t.start + t.count] if t.dim == 0 else scale


def _load_input_scale(module: Fp8Linear | Int8Linear, ckpt: Checkpoint, lin: QuantizedLinear, t: Target) -> None:
    """A static activation scale; one for a fused input: the largest of its layers' (nothing clips)."""
    name = f"{lin.prefix}.input_scale"
    if module.input_scale is not None and name in lin.members:
        given = ckpt.get(name).to(torch.float32).reshape(1)
        module.input_scale.copy_(given if t.offset == 0 else torch.maximum(module.input_scale, given))


def _load_input_range(module: Int8Linear, ckpt: Checkpoint, lin: QuantizedLinear, t: Target) -> None:
    """A static asymmetric activation scale and zero point; one for a fused input: its layers'
    (calibrated on the same input, they are equal), or where they differ the range that holds
    every layer's (nothing clips), as `per_token_quant_int8_asym` would quantize it."""
    assert module.input_scale is not None and module.input_zero_point is not None
    if f"{lin.prefix}.input_scale" not in lin.members:
        return
    scale = ckpt.get(f"{lin.prefix}.input_scale").to(torch.float32).reshape(1)
    zero_name = f"{lin.prefix}.input_zero_point"
    zero = ckpt.get(zero_name).to(torch.int32).reshape(1) if zero_name in lin.members else torch.zeros(1, dtype=torch.int32)
    old_scale, old_zero = module.input_scale.cpu(), module.input_zero_point.cpu()
    if t.offset != 0 and not (torch.equal(old_scale, scale) and torch.equal(old_zero, zero)):
        ends = [((QMIN - z) * s, (QMAX - z) * s) for s, z in ((old_scale, old_zero), (scale, zero))]
        lo, hi = torch.minimum(ends[0][0], ends[1][0]), torch.maximum(ends[0][1], ends[1][1])
        _, scale, zero = per_token_quant_int8_asym_reference(torch.cat([lo, hi])[None])
    module.input_scale.copy_(scale.reshape(1))
    module.input_zero_point.copy_(zero.reshape(1))


def _load_int4(module: PackedIntLinear, ckpt: Checkpoint, lin: QuantizedLinear, t: Target, quant: QuantConfig) -> None:
    iw = int_weights(ckpt, lin, quant)
    fill_int4(module.qweight, module.zeros, module.scales, module.group_size, iw, t, module.scale_2)
    if module.codebook is not None and iw.codebook is not None:  # (make_resident checked they are all one)
        module.codebook.copy_(iw.codebook)
    if module.fp4_input_scale is not None:  # (one for the fused layers: make_resident checked)
        module.fp4_input_scale.copy_(nvfp4.input_scale(ckpt, lin.prefix, lin.members).reshape(1))
    if module.pre_quant_scale is not None:  # AWQ's (one for the fused layers: make_resident checked)
        scale = ckpt.get(f"{lin.prefix}.pre_quant_scale").to(torch.float32)
        module.pre_quant_scale.copy_(_narrow(scale, t, dim=0) if t.dim == 1 else scale)
    if module.g_idx is not None:  # activation order: this rank's rows' groups (the fused layers share them)
        module.g_idx.copy_(_narrow(iw.groups, t, dim=0) if t.dim == 1 else iw.groups)


def fill_int4(qweight: torch.Tensor, zeros_out: torch.Tensor | None, scales_out: torch.Tensor, group_size: int,
              iw: IntWeights, t: Target, scale_2_out: torch.Tensor | None = None) -> None:
    """One packed int layout (qweight [K / (32 / bits), N], zeros and scales [G, N]; no zeros with
    a codebook; scales not float32: as the FP4 formats store them, with `scale_2_out` [N]
    NVFP4's per-tensor scale per column) filled with this rank's part of a checkpoint layer: its output columns at the
    target's offset, or its input rows in whole groups."""
    scales = iw.scales
    if scales_out.dtype != torch.float32:  # the format's own stored scales (1 byte a group)
        assert iw.stored_scales is not None and (scale_2_out is None or iw.scale_2 is not None)
        scales = iw.stored_scales
    q, zeros = iw.q, iw.zeros  # [K, N], [G, N]; scales [G, N]
    if t.dim == 0:  # this rank's output columns of W^T, at its offset in the fused layer
        cols = slice(t.offset, t.offset + t.count)
        q, zeros, scales = (_narrow(x, t, dim=1) for x in (q, zeros, scales))
    else:  # this rank's input rows, in whole groups
        cols = slice(None)
        q = _narrow(q, t, dim=0)
        if group_size > 0 and t.full is not None:  # (activation order: every group, any row may be in any)
            g = slice(t.start // group_size, cdiv(t.start + t.count, group_size))
            zeros, scales = zeros[g], scales[g]
    device = qweight.device
    qweight[:, cols] = pack_int4(q, iw.bits).to(device)
    if zeros_out is not None:
        zeros_out[:, cols] = zeros.to(device=device, dtype=zeros_out.dtype)
    scales_out[:, cols] = scales.to(device=device, dtype=scales_out.dtype)
    if scale_2_out is not None and iw.scale_2 is not None:
        factor = _narrow(iw.scale_2[None], t, dim=1)[0] if t.dim == 0 else iw.scale_2
        scale_2_out[cols] = factor.to(device)
