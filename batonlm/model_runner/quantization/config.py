"""Which quantization a checkpoint's weights are in: its `quantization_config` read and checked
against `--quantization`, once, at start-up.

`QuantConfig` (quant_config.py) is what the loader needs of it (`quantization/formats.py` reads
the tensors): the method, and per method the few fields that decide how a weight is stored.
ModelOpt's configs are read in modelopt_config.py. A config batonlm
cannot load raises `QuantizationError` naming the method, the field and what is supported.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from batonlm.model_runner.quantization.modelopt_config import modelopt_algo, read_modelopt
from batonlm.model_runner.quantization.quant_config import QuantConfig, QuantizationError

logger = logging.getLogger(__name__)

# `--quantization`'s values: auto (the checkpoint's), none, and the methods batonlm loads.
QUANTIZATION_METHODS = ("fp8", "compressed-tensors", "gptq", "awq", "modelopt", "bitsandbytes", "fbgemm_fp8", "mxfp4")
QUANTIZATION_CHOICES = ("auto", "none", *QUANTIZATION_METHODS)
_FP8_SCHEMES = ("static", "dynamic")


# Where AutoGPTQ, AutoAWQ and GPTQModel write the quantization config beside the weights (older
# GPTQ / AWQ checkpoints have it there only, not in config.json), and NVIDIA ModelOpt's
# hf_quant_config.json; transformers and vLLM read them.
QUANTIZE_CONFIG_FILES = ("quantize_config.json", "quant_config.json", "hf_quant_config.json")


def with_quantize_config(root: Path, raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` (config.json) with the quantization config of a checkpoint whose config.json has
    none but whose directory has AutoGPTQ's / AutoAWQ's file: its `quant_method`, or where it
    names none (AutoGPTQ's and AutoAWQ's older files) awq when it has AutoAWQ's fields (`w_bit`,
    `q_group_size`, `zero_point`), else gptq when it has `bits`."""
    if raw.get("quantization_config") is not None:
        return raw
    for name in QUANTIZE_CONFIG_FILES:
        path = root / name
        if not path.is_file():
            continue
        try:
            qc = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise QuantizationError(f"{path} is not valid JSON: {e}") from None
        if not isinstance(qc, dict):
            raise QuantizationError(f"{path} is not a JSON object")
        if "quant_method" not in qc:
            if name == "hf_quant_config.json" and isinstance(qc.get("quantization"), dict):
                qc = {**qc, "quant_method": "modelopt"}
            elif {"w_bit", "q_group_size", "zero_point"} & qc.keys():
                qc = {**qc, "quant_method": "awq"}
            elif "bits" in qc:
                qc = {**qc, "quant_method": "gptq"}
            else:
                raise QuantizationError(f"{path} names no quant_method, and its fields are neither GPTQ's (bits) nor "
                                        "AWQ's (w_bit, q_group_size, zero_point)")
        logger.info("quantization config read from %s (config.json has none): %s", name, qc["quant_method"])
        return {**raw, "quantization_config": qc}
    return raw


def resolve_quantization(raw: dict[str, Any], flag: str = "auto") -> QuantConfig | None:
    """The quantization batonlm loads the checkpoint of `raw` (its config.json) with, under
    `--quantization flag`; None: float weights, as they are."""
    if flag not in QUANTIZATION_CHOICES:
        raise QuantizationError(f"--quantization {flag!r} is not one of {', '.join(QUANTIZATION_CHOICES)}")
    qc = raw.get("quantization_config")
    if isinstance(qc, dict) and str(qc.get("quant_method", "")).lower() == "modelopt" and not modelopt_algo(qc):
        qc = None  # ModelOpt's KV-cache-only config (no quant_algo): float weights, KV scales beside them
    if qc is None:
        if flag == "fp8":
            return QuantConfig("fp8", online=True)
        if flag in ("auto", "none"):
            return None
        raise QuantizationError(f"--quantization {flag} needs a checkpoint quantized with {flag}; this one is not "
                                "quantized (its config.json has no quantization_config); only fp8 quantizes a "
                                "float checkpoint on load")
    if not isinstance(qc, dict):
        raise QuantizationError("config.json's quantization_config is not an object")
    method = _canonical(str(qc.get("quant_method", "")))
    if method not in QUANTIZATION_METHODS:
        raise QuantizationError(f"quantization method {qc.get('quant_method')!r} (config.json's "
                                f"quantization_config.quant_method) is not supported; batonlm loads "
                                f"{', '.join(QUANTIZATION_METHODS)}")
    if flag == "none":
        raise QuantizationError(f"the checkpoint is quantized with {method}; --quantization none cannot load it "
                                f"(use auto or {method})")
    if flag not in ("auto", method):
        raise QuantizationError(f"--quantization {flag} does not match the checkpoint's quantization method "
                                f"{method} (use auto or {method})")
    return _READERS[method](qc)


def _canonical(name: str) -> str:
    """A quant_method as QUANTIZATION_METHODS spells it (tools write compressed_tensors too)."""
    key = name.lower().replace("-", "_")
    return next((m for m in QUANTIZATION_METHODS if m.replace("-", "_") == key), name.lower())


def _fp8(qc: dict[str, Any]) -> QuantConfig:
    scheme = str(qc.get("activation_scheme", "dynamic"))
    if scheme not in _FP8_SCHEMES:
        raise QuantizationError(f"fp8 quantization_config.activation_scheme {scheme!r} is not one of "
                                f"{', '.join(_FP8_SCHEMES)}")
    block = qc.get("weight_block_size")
    if block is not None:
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise QuantizationError(f"fp8 quantization_config.weight_block_size {block!r} is not two positive "
                                    "integers")
        block = (block[0], block[1])
    return QuantConfig("fp8", block=block, activation_scheme=scheme, act_quant="fp8")


def _fbgemm_fp8(qc: dict[str, Any]) -> QuantConfig:
    """transformers' FbgemmFp8Config (Meta's Llama 3.1 405B and Llama 4 FP8 releases): an FP8
    `weight` with a `weight_scale` per output channel, activations quantized per token with
    their amax capped at `activation_scale_ub` (default 1200, transformers'); the
    `modules_to_not_convert` are stored in float."""
    ub = qc.get("activation_scale_ub", 1200.0)
    if not isinstance(ub, (int, float)) or isinstance(ub, bool) or not 0 < ub < float("inf"):
        raise QuantizationError(f"fbgemm_fp8 quantization_config.activation_scale_ub {ub!r} is not a positive "
                                "number")
    return QuantConfig("fbgemm_fp8", activation_scheme="dynamic", act_quant="fp8", act_amax_ub=float(ub))


def _int_field(qc: dict[str, Any], method: str, key: str, allowed: tuple[int, ...]) -> int:
    value = qc.get(key, qc.get("w_bit" if key == "bits" else "q_group_size"))
    if not isinstance(value, int) or value not in allowed:
        raise QuantizationError(f"{method} quantization_config.{key} {value!r} is not supported (supported: "
                                f"{', '.join(map(str, allowed))})")
    return value


def _gptq(qc: dict[str, Any]) -> QuantConfig:
    bits = _int_field(qc, "gptq", "bits", (4, 8))
    group = _int_field(qc, "gptq", "group_size", (-1, 32, 64, 128, 256))
    fmt = str(qc.get("checkpoint_format", "gptq"))
    if fmt not in ("gptq", "gptq_v2"):
        raise QuantizationError(f"gptq quantization_config.checkpoint_format {fmt!r} is not supported (supported: "
                                "gptq, gptq_v2)")
    return QuantConfig("gptq", bits=bits, group_size=group, sym=bool(qc.get("sym", True)), checkpoint_format=fmt)


def _awq(qc: dict[str, Any]) -> QuantConfig:
    bits = _int_field(qc, "awq", "bits", (4,))
    group = _int_field(qc, "awq", "group_size", (-1, 32, 64, 128, 256))
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise QuantizationError(f"awq quantization_config.version {version!r} is not supported (supported: gemm)")
    return QuantConfig("awq", bits=bits, group_size=group, sym=not bool(qc.get("zero_point", True)))


def _compressed_tensors(qc: dict[str, Any]) -> QuantConfig:
    fmt = str(qc.get("format", ""))
    supported = ("float-quantized", "pack-quantized", "int-quantized", "naive-quantized", "nvfp4-pack-quantized",
                 "mxfp4-pack-quantized", "mxfp8-quantized", "mixed-precision")
    if fmt not in supported:
        raise QuantizationError(f"compressed-tensors quantization_config.format {fmt!r} is not supported "
                                f"(supported: {', '.join(supported)})")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise QuantizationError("compressed-tensors quantization_config.config_groups is missing or empty")
    for name, group in groups.items():
        weights = group.get("weights") if isinstance(group, dict) else None
        if not isinstance(weights, dict):
            raise QuantizationError(f"compressed-tensors config_groups.{name}.weights is missing")
        kind, bits = weights.get("type"), weights.get("num_bits")
        if (kind, bits) not in (("float", 8), ("float", 4), ("int", 4), ("int", 8)):
            raise QuantizationError(f"compressed-tensors config_groups.{name}.weights: {kind} {bits}-bit is not "
                                    "supported (supported: float 8-bit, float 4-bit NVFP4, int 4-bit, int 8-bit)")
        strategy = weights.get("strategy")
        if (kind, bits) == ("float", 4) and (strategy, weights.get("group_size")) not in (("tensor_group", 16),
                                                                                          ("group", 32)):
            raise QuantizationError(f"compressed-tensors config_groups.{name}.weights: float 4-bit with strategy "
                                    f"{strategy!r} and group_size {weights.get('group_size')!r} is not supported "
                                    "(supported: NVFP4, tensor_group with groups of 16; MXFP4, group of 32)")
        if strategy not in ("tensor", "channel", "group", "block", "tensor_group"):
            raise QuantizationError(f"compressed-tensors config_groups.{name}.weights.strategy {strategy!r} is "
                                    "not supported (supported: tensor, channel, group, block, tensor_group)")
    if qc.get("sparsity_config"):
        raise QuantizationError("compressed-tensors sparsity (quantization_config.sparsity_config) is not supported")
    blocks = {tuple(g["weights"]["block_structure"]) for g in groups.values()
              if g["weights"].get("strategy") == "block" and g["weights"].get("block_structure")}
    if len(blocks) > 1:
        raise QuantizationError(f"compressed-tensors config_groups use different block structures {sorted(blocks)}; "
                                "one is supported")
    sizes = {g["weights"].get("group_size") for g in groups.values() if g["weights"].get("strategy") == "group"}
    block = blocks.pop() if blocks else None
    act_quant, act_symmetric, act_targets = _activations(groups)
    fp4 = ""
    if any((g["weights"].get("type"), g["weights"].get("num_bits")) == ("float", 4) for g in groups.values()):
        mx = fmt == "mxfp4-pack-quantized" or any(g.get("format") == "mxfp4-pack-quantized" for g in groups.values())
        fp4 = "MXFP4" if mx else "NVFP4"
    return QuantConfig("compressed-tensors", block=(block[0], block[1]) if block else None,
                       group_size=sizes.pop() if len(sizes) == 1 else -1, act_quant=act_quant,
                       act_symmetric=act_symmetric, fp4=fp4, act_targets=act_targets)


def _activations(groups: dict[str, Any]) -> tuple[str, bool, tuple[tuple[str, bool], ...]]:
    """What the config groups quantize activations to, "fp8", "mxfp8" (per 32 inputs with E8M0
    scales, kernels/mxfp8.py), "int8" (per token dynamically or per tensor statically, symmetric
    or with zero points: what the int8 kernels run), "fp4" (NVFP4's) or "none", and whether
    symmetrically; where some groups quantize their inputs and others do not, every target and
    whether its group does (`QuantConfig.act_targets`; a later group's target overrides an
    earlier one's, as compressed-tensors maps them)."""
    found = {name: _activation_kind(name, group.get("input_activations")) for name, group in groups.items()}
    kinds = {k[0] for k in found.values() if k}
    symmetric = {k[1] for k in found.values() if k and k[0] == "int8"}
    if len(kinds) > 1:
        raise QuantizationError(f"compressed-tensors config_groups quantize activations to {' and '.join(sorted(kinds))}; "
                                "one kind per checkpoint is supported")
    if len(symmetric) > 1:
        raise QuantizationError("compressed-tensors config_groups quantize int8 activations both symmetrically and "
                                "asymmetrically (input_activations.symmetric); one kind per checkpoint is supported")
    targets: dict[str, bool] = {}
    if kinds and None in found.values():
        for name, group in groups.items():
            named = group.get("targets") or []
            for t in [named] if isinstance(named, str) else named:
                targets[str(t)] = found[name] is not None
    return (kinds.pop() if kinds else "none"), symmetric.pop() if symmetric else True, tuple(targets.items())


def _activation_kind(name: str, acts: Any) -> tuple[str, bool] | None:
    """What group `name`'s `input_activations` quantize to and whether symmetrically, or None:
    its inputs stay float (none stated; int8 schemes the kernels do not run, with a warning:
    those layers run W8A16)."""
    if not isinstance(acts, dict):
        return None
    e8m0 = str(acts.get("scale_dtype")).removeprefix("torch.") == "uint8"  # MX scales
    if acts.get("type") == "float" and acts.get("num_bits") == 4:
        fp4 = (acts.get("strategy"), acts.get("group_size"), acts.get("dynamic"))
        if fp4 == ("group", 32, True) and e8m0:
            return "mxfp4", True  # MXFP4's: E8M0 scales per 32, computed per token (kernels/mxfp4.py)
        if fp4 != ("tensor_group", 16, "local"):
            raise QuantizationError(f"compressed-tensors config_groups.{name}.input_activations: float 4-bit "
                                    f"activations {fp4} are not supported (supported: NVFP4's, "
                                    "tensor_group of 16, dynamic 'local' with a calibrated global scale; MXFP4's, "
                                    "group of 32, dynamic, uint8 scales)")
        return "fp4", True
    if acts.get("type") == "float" and e8m0:
        if (acts.get("num_bits"), acts.get("strategy"), acts.get("group_size")) != (8, "group", 32):
            raise QuantizationError(f"compressed-tensors config_groups.{name}.input_activations: float "
                                    f"{acts.get('num_bits')}-bit activations with E8M0 scales per "
                                    f"{acts.get('strategy')} of {acts.get('group_size')} are not supported "
                                    "(supported: MXFP8's, 8-bit per group of 32)")
        return "mxfp8", True
    if acts.get("type") == "float":
        return "fp8", True
    if acts.get("type") == "int" and acts.get("num_bits") == 8:
        scheme = (acts.get("strategy"), bool(acts.get("dynamic")))
        if scheme in (("token", True), ("tensor", False)):
            return "int8", bool(acts.get("symmetric", True))
        logger.warning("compressed-tensors config_groups.%s.input_activations: int8 %s %s activations are not "
                       "supported (per-token dynamic and per-tensor static are); its layers run with unquantized "
                       "activations (W8A16)", name, "dynamic" if scheme[1] else "static", scheme[0])
    return None


def _bitsandbytes(qc: dict[str, Any]) -> QuantConfig:
    """transformers' BitsAndBytesConfig: 4-bit NF4 or FP4 (with or without double quantization,
    `bnb.py`), kept packed where the integer formats are; 8-bit LLM.int8 (int8 weights and
    activations, outlier columns in float: `LlmInt8Linear`, on every device)."""
    if qc.get("load_in_8bit") or qc.get("_load_in_8bit"):
        if qc.get("llm_int8_has_fp16_weight"):
            raise QuantizationError("bitsandbytes quantization_config.llm_int8_has_fp16_weight is true: its weights "
                                    "are not saved in 8 bits (supported: false)")
        threshold = qc.get("llm_int8_threshold", 6.0)
        if not isinstance(threshold, (int, float)) or isinstance(threshold, bool) or threshold < 0:
            raise QuantizationError(f"bitsandbytes quantization_config.llm_int8_threshold {threshold!r} is not a "
                                    "non-negative number")
        return QuantConfig("bitsandbytes", bits=8, act_quant="int8", llm_int8_threshold=float(threshold))
    if not (qc.get("load_in_4bit") or qc.get("_load_in_4bit")):
        raise QuantizationError("bitsandbytes quantization_config has neither load_in_4bit nor load_in_8bit set "
                                "(supported: 4-bit nf4 or fp4, 8-bit LLM.int8)")
    kind = str(qc.get("bnb_4bit_quant_type", "fp4")).lower()
    if kind not in ("nf4", "fp4"):
        raise QuantizationError(f"bitsandbytes quantization_config.bnb_4bit_quant_type {kind!r} is not supported "
                                "(supported: nf4, fp4)")
    return QuantConfig("bitsandbytes", bits=4)


_READERS = {"fp8": _fp8, "gptq": _gptq, "awq": _awq, "compressed-tensors": _compressed_tensors, "modelopt": read_modelopt,
            "bitsandbytes": _bitsandbytes, "fbgemm_fp8": _fbgemm_fp8, "mxfp4": lambda qc: QuantConfig("mxfp4")}
