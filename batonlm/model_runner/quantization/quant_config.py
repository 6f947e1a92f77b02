"""`QuantConfig`: one checkpoint's quantization as the loader needs it (config.py reads it from
the checkpoint's `quantization_config`), and `QuantizationError`, a config batonlm cannot load."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, replace


class QuantizationError(ValueError):
    """A quantization config batonlm cannot load (or one the flag contradicts)."""


@dataclass(frozen=True)
class QuantConfig:
    """One checkpoint's quantization. `method`: one of QUANTIZATION_METHODS. `online`: the
    checkpoint is not quantized; its linear weights are rounded to FP8 on load (`--quantization
    fp8` on a float checkpoint). `bits`/`group_size`: the integer formats' (GPTQ, AWQ;
    compressed-tensors states them per tensor group, and its tensors say the rest). `sym`: GPTQ's
    symmetric zeros. `checkpoint_format`: GPTQ's zero convention (`gptq`: stored zero = zero - 1,
    the v1 format AutoGPTQ and GPTQModel write; `gptq_v2`: stored as is). `block`: FP8's
    `weight_block_size`. `activation_scheme`: FP8's (static: the checkpoint's `input_scale`;
    dynamic: per token). `act_quant`: what the layers quantize their inputs to, "fp8" or "int8"
    (W8A8), "fp4" (NVFP4 W4A4), "mxfp8" ("none": weight-only); such layers stay quantized on
    every device, so the outputs are the checkpoint's (transformers'). `act_symmetric`: False where int8 activations have a zero
    point (compressed-tensors' `symmetric: false`: per token, or the checkpoint's
    `input_zero_point`). `llm_int8_threshold`: bitsandbytes 8-bit's (LLM.int8) outlier threshold,
    activations at least this large multiplied in float (0: none). `act_amax_ub`: FBGEMM FP8's
    `activation_scale_ub`, a token's amax capped at it before its scale is taken (None: not capped).
    `act_targets`: where a compressed-tensors checkpoint's config groups disagree on quantizing
    their inputs (W8A8 groups beside weight-only ones), each group target and whether its layers
    quantize their inputs, in the config's order (`quantizes_inputs` matches a layer to one).
    Which modules are quantized the checkpoint's tensors say (a module left in float, e.g. one
    of `modules_to_not_convert` or compressed-tensors' `ignore`, has a float `weight`)."""

    method: str
    online: bool = False
    bits: int = 0
    group_size: int = -1
    sym: bool = True
    checkpoint_format: str = "gptq"
    block: tuple[int, int] | None = None
    activation_scheme: str = "dynamic"
    act_quant: str = "none"  # "fp8" / "int8" / "fp4" / "mxfp8" / "mxfp4": the checkpoint's layers quantize their inputs
    act_symmetric: bool = True
    llm_int8_threshold: float = 0.0
    fp4: str = ""  # the FP4 weight format, "NVFP4" or "MXFP4" (compressed-tensors'; ModelOpt's NVFP4)
    mixed: tuple[str, ...] = ()  # ModelOpt's MIXED_PRECISION: its layers' algorithms (each layer's tensors say which)
    act_amax_ub: float | None = None
    act_targets: tuple[tuple[str, bool], ...] = ()

    def quantizes_inputs(self, layer: str) -> bool:
        """Whether the checkpoint layer `layer` (its module name) quantizes its inputs: by the
        compressed-tensors group its name matches where the groups disagree (`act_targets`)."""
        if not self.act_targets:
            return self.act_quant != "none"
        target = group_target(layer, [t for t, _ in self.act_targets])
        return self.act_quant != "none" if target is None else dict(self.act_targets)[target]

    def for_layers(self, module: str, layers: Iterable[str]) -> QuantConfig:
        """This config as the projection `module` (the checkpoint layers `layers`, fused) runs:
        itself, or weight-only where none of its layers quantize their inputs; layers fused into
        one input that disagree are refused (one input is quantized or not)."""
        if not self.act_targets:
            return self
        kinds = {layer: self.quantizes_inputs(layer) for layer in layers}
        if set(kinds.values()) == {False}:
            return replace(self, act_quant="none", act_targets=())
        if set(kinds.values()) == {True}:
            return self
        yes, no = [k for k, v in kinds.items() if v], [k for k, v in kinds.items() if not v]
        raise QuantizationError(f"{module}: the config groups quantize the inputs of {_some(yes)} and not of "
                                f"{_some(no)}, layers batonlm runs as one (fused, or one MoE layer's experts); "
                                "their groups must agree")

    @property
    def description(self) -> str:
        if self.online:
            return "fp8 (online, from the float checkpoint)"
        if self.method in ("gptq", "awq"):
            return f"{self.method} int{self.bits} (group {self.group_size}{'' if self.sym else ', asymmetric'})"
        if self.method == "fp8":
            static = ", static activation scales" if self.activation_scheme == "static" else ""
            return "fp8 " + (f"({self.block[0]}x{self.block[1]} blocks{static})" if self.block else f"(per tensor{static})")
        if self.method == "bitsandbytes":
            if self.bits == 8:
                return f"bitsandbytes 8-bit (LLM.int8: int8 activations, outliers from {self.llm_int8_threshold:g} in float)"
            return "bitsandbytes 4-bit"
        if self.method == "mxfp4":
            return "mxfp4 (gpt-oss's MoE experts)"
        if self.method == "fbgemm_fp8":
            return f"fbgemm_fp8 (per channel, dynamic activations, amax capped at {self.act_amax_ub:g})"
        if self.mixed:
            quantized = "FP8_PB_WO weight-only, the others' activations quantized" if "FP8_PB_WO" in self.mixed \
                else "activations quantized"
            return f"modelopt mixed precision ({' and '.join(self.mixed)} layers; {quantized})"
        if self.method == "modelopt" and self.act_quant == "none" and not self.fp4:
            return {8: "modelopt int8 (per channel, weight-only)", 4: "modelopt int4 AWQ (weight-only, pre-quant scales)"
                    }.get(self.bits, "modelopt fp8 (128x128 blocks, weight-only)")
        if self.method == "modelopt" and self.act_quant == "mxfp8":
            return "modelopt mxfp8 (weights and activations)"
        if self.method == "modelopt" and not self.fp4:
            return "modelopt fp8 " + ("(per tensor, static activation scales)" if self.activation_scheme == "static"
                                      else "(per channel, dynamic activations)")
        asym = "" if self.act_symmetric else "asymmetric "
        if self.fp4:
            return self.method + (f" ({self.fp4} weights and activations)" if self.act_quant in ("fp4", "mxfp4")
                                  else f" ({self.fp4} weights)")
        some = ", weight-only where its config groups say" if self.act_targets else ""
        return self.method + (f" ({asym}{self.act_quant} activations{some})" if self.act_quant != "none" else "")


def _some(names: list[str]) -> str:
    return names[0] + (f" (and {len(names) - 1} more)" if len(names) > 1 else "")


def group_target(layer: str, targets: list[str]) -> str | None:
    """The compressed-tensors target a linear layer named `layer` takes its scheme from, as
    compressed-tensors' `match_targets` orders them: an exact name first, then a regular
    expression ("re:", matched from the name's start), each kind in sorted order, then a class
    name (a linear layer's "Linear"); None where none matches."""
    ordered = sorted(targets, key=lambda t: (t.startswith("re:"), t))
    for t in ordered:
        if t == layer or (t.startswith("re:") and re.match(t[3:], layer)):
            return t
    return next((t for t in ordered if t in ("Linear", "Module")), None)
