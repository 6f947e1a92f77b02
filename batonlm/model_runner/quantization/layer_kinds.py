"""Which quantized layer a projection's checkpoint layers can become (resident.py,
resident_experts.py): their packed layout's group size, codebook, stored scales and AWQ's
pre-quantization scale, and whether int8 or FP8 layers are per channel, static or weight-only."""

from __future__ import annotations

import math

import torch

from batonlm.model_runner.checkpoint import Checkpoint
from batonlm.model_runner.quantization import nvfp4
from batonlm.model_runner.quantization.config import QuantConfig, QuantizationError
from batonlm.model_runner.quantization.formats import QuantizedLinear, group_index_name, int_layout
from batonlm.model_runner.weight_loader import Target


def stored_scales(ckpt: Checkpoint, sources: list[tuple[QuantizedLinear, Target]]) -> tuple[str, bool]:
    """How a packed layer of these checkpoint layers keeps their group scales (a key of
    STORED_SCALES): "float8", NVFP4's as they are (all NVFP4 in one layout, float8 scales), "e8m0",
    MXFP4's and MXFP8's exponents, "" float32; and whether NVFP4's per-tensor scale divides them
    (compressed-tensors' global scale) rather than multiplies (ModelOpt's scale_2)."""
    if {lin.storage for lin, _ in sources} <= {"mxfp4", "mxfp8"}:
        return "e8m0", False
    layouts = {nvfp4.layout(lin.members) if lin.storage == "nvfp4" else "" for lin, _ in sources}
    fp8 = len(layouts) == 1 and "" not in layouts and all(ckpt.dtype(lin.members[1]) == "F8_E4M3" for lin, _ in sources)
    return ("float8" if fp8 else ""), fp8 and layouts == {"compressed-tensors"}


def same_codebook(books: list[torch.Tensor | None]) -> bool:
    """A fused projection's layers all integer, or all with one codebook (bitsandbytes' NF4 or FP4
    table: every layer of a checkpoint has the same; FP8's, with its NaN codes)."""
    first = books[0]
    if first is None:
        return all(b is None for b in books)
    return all(b is not None and b.shape == first.shape and bool(b.isclose(first, 0, 0, equal_nan=True).all())
               for b in books)


def per_channel_scale(ckpt: Checkpoint, lin: QuantizedLinear) -> bool:
    """The layer's weight scale is one per output channel, or one per tensor."""
    n = lin.shape[0]
    scale = Checkpoint.shape(ckpt, lin.members[1])
    return math.prod(scale) == 1 or tuple(scale) in ((n,), (n, 1))


def static_scale(lin: QuantizedLinear) -> bool:
    return any(m.endswith(".input_scale") for m in lin.members)


# Storages the packed int layout holds (`PackedIntLinear`, `Int4Experts`): 4- and 8-bit codes,
# integers or a codebook's indices. "int": unpacked integer weights (W8A16, W4AFP8 / W4A8's int4
# values in int8, W8A8 int8 the int8 kernels do not run: scaled per group or with zero points).
PACKED_STORAGES = frozenset({"gptq", "awq", "packed", "bnb4", "nvfp4", "mxfp4", "fp8wo", "mxfp8", "moint4", "int"})


def input_quant(quant: QuantConfig, storages: set[str], static: bool, module_name: str) -> str:
    """How packed layers of `storages` quantize their inputs and back, as a key of
    kernels/input_quant.INPUT_QUANTS ("": they do not, or NVFP4 W4A4's own): MXFP8's in its tool's
    rule; FP8 or int8 per token where the checkpoint quantizes the inputs of integer weights
    (llm-compressor's W4AFP8, W4A8; W8A8 int8 scaled per group). Weight-only FP8 layers
    (`fp8wo`) take none whatever the checkpoint's other layers do."""
    if quant.act_quant in ("mxfp8", "mxfp4") and storages == {quant.act_quant}:
        return f"{quant.act_quant}-{quant.method}"
    if quant.act_quant not in ("fp8", "int8") or "fp8wo" in storages:
        return ""
    if static:
        raise QuantizationError(f"{module_name}: packed weights with static {quant.act_quant} activation scales "
                                "(input_scale) are not supported; dynamic per-token activations are")
    return "fp8" if quant.act_quant == "fp8" else "int8" if quant.act_symmetric else "int8-asym"


def int8_per_channel(ckpt: Checkpoint, lin: QuantizedLinear) -> bool:
    """An int8 layer the W8A8-int8 kernels run: signed codes, no zeros, a scale per output
    channel or per tensor."""
    return (Checkpoint.dtype(ckpt, f"{lin.prefix}.weight") == "I8" and f"{lin.prefix}.weight_zero_point" not in lin.members
            and per_channel_scale(ckpt, lin))


def int4_group(
    ckpt: Checkpoint, module_name: str, sources: list[tuple[QuantizedLinear, Target]], quant: QuantConfig
) -> int | None:
    """The group size the packed int layout takes (-1: one group; 0: GPTQ's activation order, one
    `g_idx` its layers share, as a fused projection's do: their Hessians are of the same input),
    or None: not 4- or 8-bit, layers of different widths, or layers ordered differently. A slice
    that would split a group is refused (in activation order a rank's rows keep their own
    groups: any slice)."""
    sizes = set()
    order: torch.Tensor | None = None
    widths = {int_layout(ckpt, lin, quant)[0] for lin, _ in sources}
    if len(widths) != 1 or not widths <= {4, 8}:
        return None
    for lin, t in sources:
        _, size, _ = int_layout(ckpt, lin, quant)
        if size is None:  # activation order: the checkpoint's g_idx (GPTQ) or weight_g_idx (compressed-tensors)
            name = group_index_name(lin)
            g_idx = ckpt.get(name) if name is not None else None
            if g_idx is None or (order is not None and not torch.equal(order, g_idx)):
                return None
            order, size = g_idx, 0
        if t.dim == 1 and size > 0 and size != -1 and (t.start % size or (t.count % size and t.start + t.count != t.full)):
            raise QuantizationError(f"{module_name}: this rank's input features [{t.start}, {t.start + t.count}) of "
                                    f"{lin.prefix} would split its groups of {size} rows; choose a --tp that "
                                    "divides them into whole groups")
        sizes.add(size)
    if len(sizes) != 1:
        raise QuantizationError(f"{module_name}: its checkpoint layers have different group sizes {sorted(sizes)}")
    return sizes.pop()


def pre_quant_scale(ckpt: Checkpoint, module_name: str, sources: list[tuple[QuantizedLinear, Target]],
                    ) -> torch.Tensor | None:
    """The input scale AWQ's `pre_quant_scale` multiplies a packed layer's input by (float32
    [K]), None where its layers have none; a start-up error where some of a fused layer's have
    one and some not, or different ones (ModelOpt's export gives fused layers one)."""
    names = [f"{lin.prefix}.pre_quant_scale" for lin, _ in sources]
    present = [n in lin.members for n, (lin, _) in zip(names, sources)]
    if not any(present):
        return None
    scales = [ckpt.get(n).to(torch.float32) for n, there in zip(names, present) if there]
    if not all(present) or any(not torch.equal(s, scales[0]) for s in scales):
        raise QuantizationError(f"{module_name}: its layers' pre_quant_scale differ (or some have none); fused "
                                "layers multiply their one input by one")
    return scales[0]
