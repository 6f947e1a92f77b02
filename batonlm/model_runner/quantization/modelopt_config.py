"""NVIDIA ModelOpt's quantization configs (TensorRT Model Optimizer's `export_hf_checkpoint`): its
`quant_algo` in config.json's quantization_config, or under `quantization` in
hf_quant_config.json, read into a `QuantConfig`."""

from __future__ import annotations

from typing import Any

from batonlm.model_runner.quantization.quant_config import QuantConfig, QuantizationError

_MODELOPT_ALGOS = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO", "MXFP8", "NVFP4", "NVFP4_AWQ", "W4A16_AWQ",
                   "W4A16_NVFP4", "W8A16", "MIXED_PRECISION")
_MODELOPT_MIXED = ("FP8", "FP8_PB_WO", "NVFP4")  # the per-layer algorithms of MIXED_PRECISION batonlm runs


def modelopt_algo(qc: dict[str, Any]) -> str:
    """A ModelOpt config's weight `quant_algo` ("" when it quantizes the KV cache only)."""
    nested = qc.get("quantization")
    inner: dict[str, Any] = nested if isinstance(nested, dict) else qc
    return str(inner.get("quant_algo") or "")


def read_modelopt(qc: dict[str, Any]) -> QuantConfig:
    """NVIDIA ModelOpt (TensorRT Model Optimizer): its `quant_algo` in config.json's
    quantization_config, or under `quantization` (hf_quant_config.json's layout). FP8: an FP8
    weight with one scale per tensor and a static activation scale per layer (`input_scale`), the
    tensors AutoFP8 writes too; FP8_PER_CHANNEL_PER_TOKEN: a scale per output channel and dynamic
    per-token activations. NVFP4: FP4 weights (`nvfp4.py`) and FP4 activations with each layer's
    calibrated `input_scale` (W4A4, kernels/fp4.py), NVFP4_AWQ the same with AWQ's
    `pre_quant_scale` multiplying the inputs its export did not fold into a norm or the previous
    layer; W4A16_NVFP4: the weights only; FP8_PB_WO:
    FP8 weights with a scale per 128x128 block, float activations (fp8_weight_only.py); W8A16:
    int8 weights with a scale per output channel, float activations; MXFP8: FP8 weights with an
    E8M0 exponent per 32 inputs (`mxfp8.py`), inputs quantized alike (kernels/mxfp8.py);
    W4A16_AWQ: symmetric int4 per group with AWQ's `pre_quant_scale` on the inputs of the
    layers no norm absorbed it into (`modelopt_int4.py`); MIXED_PRECISION
    (`mtq.auto_quantize`'s export): FP8, FP8_PB_WO and NVFP4 layers as `quantized_layers` lists
    them, each read as its tensors say. Layers it excludes are stored in float."""
    algo = modelopt_algo(qc)
    if algo.upper() not in _MODELOPT_ALGOS:
        raise QuantizationError(f"modelopt quant_algo {algo!r} is not supported (supported: "
                                f"{', '.join(_MODELOPT_ALGOS)})")
    algo = algo.upper()
    nested = qc.get("quantization")
    inner: dict[str, Any] = nested if isinstance(nested, dict) else qc
    if algo == "MIXED_PRECISION":
        return _modelopt_mixed(inner)
    if algo in ("NVFP4", "NVFP4_AWQ", "W4A16_NVFP4"):  # (NVFP4_AWQ: NVFP4 with a pre_quant_scale on some inputs)
        _check_nvfp4_group(algo, inner)
        return QuantConfig("modelopt", group_size=16, act_quant="none" if algo == "W4A16_NVFP4" else "fp4", fp4="NVFP4")
    if algo == "MXFP8":
        return QuantConfig("modelopt", group_size=32, act_quant="mxfp8")
    if algo == "W4A16_AWQ":  # INT4_AWQ_CFG: symmetric int4 per group, `pre_quant_scale` where no norm took it
        if inner.get("has_zero_point"):
            raise QuantizationError("modelopt W4A16_AWQ has_zero_point true is not supported (supported: false, "
                                    "ModelOpt's symmetric int4)")
        return QuantConfig("modelopt", bits=4, act_quant="none")
    if algo in ("FP8_PB_WO", "W8A16"):
        return QuantConfig("modelopt", bits=8 if algo == "W8A16" else 0, act_quant="none")
    return QuantConfig("modelopt", activation_scheme="static" if algo == "FP8" else "dynamic", act_quant="fp8")


def _check_nvfp4_group(what: str, qc: dict[str, Any]) -> None:
    group = qc.get("group_size", 16)
    if group != 16:
        raise QuantizationError(f"modelopt {what} group_size {group!r} is not supported (supported: 16)")


def _modelopt_mixed(qc: dict[str, Any]) -> QuantConfig:
    """MIXED_PRECISION: each layer's algorithm in `quantized_layers`; FP8 (static activation
    scales), FP8_PB_WO (weight-only, blocks) and NVFP4 (FP4 activations) layers, their activations
    quantized as each says."""
    layers = qc.get("quantized_layers")
    if not isinstance(layers, dict) or not layers:
        raise QuantizationError("modelopt MIXED_PRECISION quantized_layers is missing or empty")
    algos = set()
    for name, layer in layers.items():
        algo = str(layer.get("quant_algo", "") if isinstance(layer, dict) else "").upper()
        if algo not in _MODELOPT_MIXED:
            raise QuantizationError(f"modelopt MIXED_PRECISION quantized_layers.{name}.quant_algo {algo!r} is not "
                                    f"supported (supported: {', '.join(_MODELOPT_MIXED)})")
        if algo == "NVFP4":
            _check_nvfp4_group(f"MIXED_PRECISION quantized_layers.{name}", layer)
        algos.add(algo)
    fp4 = "NVFP4" in algos
    return QuantConfig("modelopt", group_size=16 if fp4 else -1, activation_scheme="static",
                       act_quant="fp4" if fp4 else "fp8", fp4="NVFP4" if fp4 else "", mixed=tuple(sorted(algos)))
