"""transformers' logits for each fixture, checked against the fixture's dequantized float32 weights,
saved as <fixture>/reference.safetensors (README.md here says with which venvs).

    V/bin/python tests/data/quantized/make_references.py [--write] NAME...

For each fixture: transformers loads it (AutoModelForCausalLM, dtype float32, CPU) through its own
quantization integration (compressed-tensors; GPTQModel + optimum with its torch kernels), runs
PROMPT and a greedy continuation.
Independently, the script dequantizes the checkpoint's tensors from the formats' descriptions
(compressed-tensors: fp8 * scale, int codes + offset packed low bits first; GPTQ / AWQ: the
readers in tests/quant_formats.py, checked against the tools by check_packing.py), puts them into
a plain float32 LlamaForCausalLM (for W8A8 fixtures, with each Linear's input quantized to
float8 per token / per 128-group or int8 per token as the scheme says, which transformers does too) and compares the
logits. With --write, the transformers numbers
(not ours) are saved: input_ids, logits [T, vocab] float32 and greedy_ids, with the versions and
the measured difference in the file's metadata.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))
import quant_formats as qf  # noqa: E402

PROMPT = "Once upon a time"
GREEDY_TOKENS = 16


def load_tensors(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for p in sorted(d.glob("*.safetensors")):
        if p.name == "reference.safetensors":
            continue
        with safe_open(str(p), "pt") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k)
    return out


def unpack_ct(packed: torch.Tensor, bits: int, n: int, dim: int) -> torch.Tensor:
    """compressed-tensors pack-quantized: signed codes + 2^(bits-1), packed densely along `dim`,
    element i at bit i*bits of the little-endian int32 stream. Returns signed int64 codes."""
    if dim == 0:
        packed = packed.T
    words = packed.to(torch.int64) & 0xFFFFFFFF
    f = 32 // bits
    shifts = torch.arange(f, dtype=torch.int64) * bits
    codes = ((words.unsqueeze(-1) >> shifts) & (2**bits - 1)).reshape(words.shape[0], -1)[:, :n]
    codes = codes - (1 << (bits - 1))
    return codes.T if dim == 0 else codes


def dequantize_ct(t: dict[str, torch.Tensor], qcfg: dict) -> dict[str, torch.Tensor]:
    group, *others = qcfg["config_groups"].values()
    w_args = group["weights"]
    assert all(g["weights"] == w_args for g in others), "one weight scheme a fixture"
    fmt = group.get("format") or qcfg["format"]  # (fp8-mixed-wo's weight-only group is "naive-quantized": alike)
    out = {}
    for k in list(t):
        if fmt == "mxfp8-quantized" and k.endswith(".weight_scale"):  # FP8 codes, an E8M0 exponent per 32 inputs
            p = k[: -len(".weight_scale")]
            s = 2.0 ** (t[k].to(torch.float64) - 127)
            w = t[p + ".weight"].to(torch.float64)
            out[p + ".weight"] = (w * s.repeat_interleave(32, dim=1)[:, : w.shape[1]]).float()
        elif fmt in ("float-quantized", "int-quantized") and k.endswith(".weight_scale"):
            p = k[: -len(".weight_scale")]
            w = t[p + ".weight"].to(torch.float32)
            s = t[k].to(torch.float32)
            if w_args["strategy"] == "block":
                bn, bk = w_args["block_structure"]
                s = s.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[: w.shape[0], : w.shape[1]]
            elif w_args["strategy"] == "group":  # (W4AFP8 / W4A8: int4 values in an int8 `weight`)
                s = s.repeat_interleave(w_args["group_size"], 1)[:, : w.shape[1]]
            out[p + ".weight"] = w * s
        elif fmt == "pack-quantized" and k.endswith(".weight_packed"):
            p = k[: -len(".weight_packed")]
            bits = w_args["num_bits"]
            N, K = t[p + ".weight_shape"].tolist()
            q = unpack_ct(t[k], bits, K, 1)
            s = t[p + ".weight_scale"].to(torch.float32)  # [N, K/G]
            G = w_args["group_size"] or K
            if p + ".weight_zero_point" in t:
                z = unpack_ct(t[p + ".weight_zero_point"], bits, N, 0)  # [N, K/G]
            else:
                z = torch.zeros_like(s, dtype=torch.int64)
            if p + ".weight_g_idx" in t:
                gi = t[p + ".weight_g_idx"].long()
            else:
                gi = torch.arange(K) // G
            out[p + ".weight"] = s[:, gi] * (q - z[:, gi]).to(torch.float32)
        elif fmt in ("nvfp4-pack-quantized", "mxfp4-pack-quantized") and k.endswith(".weight_packed"):
            # E2M1 codes, two a byte (the even element low), sign in bit 3; NVFP4: FP8 scales per
            # 16 inputs divided by the global scale, W = value * (scale / global); MXFP4: E8M0
            # exponents per 32 inputs, W = value * 2^(e - 127)
            p = k[: -len(".weight_packed")]
            byte = t[k].to(torch.int64)
            codes = torch.stack([byte & 15, byte >> 4], dim=2).reshape(byte.shape[0], -1)
            mag = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])[codes & 7]
            value = torch.where(codes >= 8, -mag, mag)
            if fmt == "nvfp4-pack-quantized":
                s, group = t[p + ".weight_scale"].to(torch.float32) / t[p + ".weight_global_scale"].to(torch.float32), 16
            else:
                s, group = 2.0 ** (t[p + ".weight_scale"].to(torch.float64) - 127), 32
            out[p + ".weight"] = (value.double() * s.double().repeat_interleave(group, dim=1)[:, : value.shape[1]]).float()
    return out


def dequantize_modelopt(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ModelOpt NVFP4 (`weight` uint8 two E2M1 codes a byte, float8 `weight_scale` per 16 inputs,
    float32 `weight_scale_2`): read by ModelOpt's `NVFP4QTensor.dequantize`, W = value * (scale *
    scale_2); FP8 (a float8 `weight`, its `weight_scale` per tensor, or per 128x128 block:
    FP8_PB_WO, its [N/128, 1, K/128, 1] scale as the [N/128, K/128] one it was) by
    `FP8QTensor.dequantize`; int8 (W8A16: a `weight_scale` per output row) by
    `INT8QTensor.dequantize`, the scale as a column; MXFP8 (float8 `weight`, a uint8 E8M0
    `weight_scale` per 32 inputs) by `MXFP8QTensor.dequantize`."""
    from modelopt.torch.quantization.qtensor.fp8_tensor import FP8QTensor
    from modelopt.torch.quantization.qtensor.int8_tensor import INT8QTensor
    from modelopt.torch.quantization.qtensor.mxfp8_tensor import MXFP8QTensor
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    deq = {}
    for k in t:
        if k.endswith(".weight") and t[k].dtype == torch.float8_e4m3fn and t[k + "_scale"].dtype == torch.uint8:
            deq[k] = MXFP8QTensor(t[k].shape, torch.float32, t[k]).dequantize(dtype=torch.float32, scale=t[k + "_scale"])
        elif k.endswith(".weight") and t[k].dtype == torch.float8_e4m3fn:
            scale = t[k + "_scale"].float()
            blocks = {}
            if scale.dim() == 4:
                scale, blocks = scale.reshape(scale.shape[0], scale.shape[2]), {"block_sizes": {-1: 128, -2: 128}}
            deq[k] = FP8QTensor(t[k].shape, torch.float32, t[k]).dequantize(
                dtype=torch.float32, scale=scale, **blocks).float()
        if k.endswith(".weight") and t[k].dtype == torch.uint8 and k + "_scale" in t and \
                t[k + "_scale"].dtype == torch.float32 and 2 * t[k].shape[0] == t[k + "_scale"].shape[0]:
            # W4A16_AWQ: two signed int4 codes a byte along N (rows 2i low, 2i + 1 high: ModelOpt's
            # pack_int4_in_uint8 undone), W = q * scale of its group of inputs
            b = t[k].to(torch.int32)
            q = torch.stack([b & 15, b >> 4], dim=1).reshape(2 * b.shape[0], b.shape[1])
            q = torch.where(q >= 8, q - 16, q).double()
            s = t[k + "_scale"].double()
            deq[k] = (q * s.repeat_interleave(-(-q.shape[1] // s.shape[1]), dim=1)[:, : q.shape[1]]).float()
        if k.endswith(".weight") and t[k].dtype == torch.int8 and k + "_scale" in t:
            deq[k] = INT8QTensor(t[k].shape, torch.float32, t[k]).dequantize(
                dtype=torch.float32, scale=t[k + "_scale"].float().reshape(-1, 1)).float()
        if k.endswith(".weight_scale_2"):
            p = k.removesuffix("_scale_2")
            packed = t[p]
            shape = torch.Size([packed.shape[0], 2 * packed.shape[1]])
            q = NVFP4QTensor(shape, torch.float32, packed)
            deq[p] = q.dequantize(dtype=torch.float32, scale=t[p + "_scale"], double_scale=t[k].float(),
                                  block_sizes={-1: 16}).float()
    return deq


def add_modelopt_fp4_activation_quant(model, tensors: dict[str, torch.Tensor]) -> None:
    """ModelOpt's NVFP4 activations (W4A4): every decoder Linear's input quantized to NVFP4 per 16
    inputs with the layer's `input_scale` as the per-tensor scale and dequantized, by ModelOpt's own
    `NVFP4QTensor.quantize` / `dequantize` (the functions its export quantizes the weights with),
    in float32. (Its fake-quant kernel needs CUDA, and Triton's interpreter mis-rounds float8
    conversions that carry into the next power of two, so that kernel cannot be the reference here.)"""
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name + ".weight_scale_2" in tensors:
            scale = tensors[name + ".input_scale"].float()

            def hook(mod, inputs, scale=scale):
                x = inputs[0].float()
                q, block_scale, tensor_scale = NVFP4QTensor.quantize(x, 16, weights_scaling_factor_2=scale)
                y = q.dequantize(dtype=torch.float32, scale=block_scale, double_scale=tensor_scale, block_sizes={-1: 16})
                return (y.reshape(x.shape),)

            mod.register_forward_pre_hook(hook)


def dequantized_state(d: Path) -> dict[str, torch.Tensor]:
    cfg = json.loads((d / "config.json").read_text())
    qcfg = cfg.get("quantization_config")
    t = load_tensors(d)
    if qcfg is None:
        return {k: v.float() for k, v in t.items()}
    method = qcfg["quant_method"]
    if method == "compressed-tensors":
        deq = dequantize_ct(t, qcfg)
    elif method == "gptq":
        deq = {}
        for k in t:
            if k.endswith(".qweight"):
                p = k[: -len(".qweight")]
                deq[p + ".weight"] = qf.dequantize_gptq(t[k], t[p + ".qzeros"], t[p + ".scales"], t[p + ".g_idx"], qcfg["bits"])
    elif method == "bitsandbytes":  # bitsandbytes' own dequantization (the script runs in its venv)
        import bitsandbytes.functional as bnbf

        deq = {}
        for k in t:
            if k.endswith(".quant_state.bitsandbytes__nf4") or k.endswith(".quant_state.bitsandbytes__fp4"):
                w = k[: k.index(".quant_state")]
                parts = {n.removeprefix(w + "."): v for n, v in t.items() if n.startswith(w + ".")}
                state = bnbf.QuantState.from_dict(parts, device=torch.device("cpu"))
                deq[w] = bnbf.dequantize_4bit(t[w], state).float()
            elif k.endswith(".SCB"):  # 8-bit (LLM.int8): int8 rows and their scales
                w = k.removesuffix(".SCB") + ".weight"
                deq[w] = bnbf.int8_vectorwise_dequant(t[w], t[k]).float()
    elif method == "modelopt":  # ModelOpt's own reader (the script runs in its venv)
        deq = dequantize_modelopt(t)
    elif method == "awq":
        deq = {}
        for k in t:
            if k.endswith(".qweight"):
                p = k[: -len(".qweight")]
                deq[p + ".weight"] = qf.dequantize_awq(t[k], t[p + ".qzeros"], t[p + ".scales"], qcfg["group_size"])
    else:
        raise ValueError(method)
    assert len(deq) == 14, len(deq)
    plain = {k: v.float() for k, v in t.items() if k.endswith(("norm.weight", "embed_tokens.weight", "lm_head.weight"))}
    plain.update(deq)
    return plain


def dequantized_model(d: Path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("quantization_config", None)
    cfg["dtype"] = "float32"
    model = LlamaForCausalLM(LlamaConfig(**cfg)).to(torch.float32).eval()
    state = dequantized_state(d)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return model


def activation_args(d: Path) -> dict | None:
    """The 8-bit (float8 or int8) or NVFP4 input_activations args of a compressed-tensors fixture,
    if any."""
    qcfg = json.loads((d / "config.json").read_text()).get("quantization_config") or {}
    if qcfg.get("quant_method") != "compressed-tensors":
        return None
    groups = [g for g in qcfg["config_groups"].values() if g.get("input_activations")] or [None]
    (group,) = groups  # (one activation scheme a fixture; other groups weight-only: `weight_only_layers`)
    a = group.get("input_activations") if group else None
    if a and a["num_bits"] == 8 and (a["dynamic"] or a["type"] == "int"):
        return a
    if a and (a["type"], a["num_bits"]) == ("float", 4):
        return a
    return None


def add_activation_quant(model, args: dict, d: Path) -> None:
    if (args["type"], args["num_bits"]) == ("float", 4) or args.get("scale_dtype") == "torch.uint8":
        add_fp4_activation_quant(model, args, load_tensors(d))  # (MXFP8 too: compressed-tensors' own arithmetic)
    elif args["type"] == "float":
        add_fp8_activation_quant(model, args)
    elif args["dynamic"]:
        add_int8_activation_quant(model, args)
    else:
        add_static_int8_activation_quant(model, load_tensors(d))
    for name in weight_only_layers(model, d):  # their inputs stay float: the hook off again
        model.get_submodule(name)._forward_pre_hooks.clear()


def weight_only_layers(model, d: Path) -> list[str]:
    """The decoder Linears whose config group quantizes no inputs, where a compressed-tensors
    fixture's groups disagree (`fp8-mixed-wo`): each layer's group as compressed-tensors' own
    `match_targets` picks it (its first target: exact names, then regular expressions, then
    class names)."""
    from compressed_tensors.utils.match import match_targets

    qcfg = json.loads((d / "config.json").read_text())["quantization_config"]
    scheme = {}
    for group in qcfg["config_groups"].values():
        for t in group["targets"]:
            scheme[t] = group
    out = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and not name.endswith("lm_head"):
            found = match_targets(name, mod, list(scheme))
            if found and not scheme[found[0]].get("input_activations"):
                out.append(name)
    return out


def asym_int8(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """x quantized to int8 with a zero point and back: codes = round-half-even(x / scale + zero)
    clamped to [-128, 127]; value = (code - zero) * scale (compressed-tensors' `_quantize` /
    `_dequantize`, the division and the addition rounded separately)."""
    return (torch.round(x / scale + zero).clamp(-128, 127) - zero) * scale


def add_fp8_activation_quant(model, args: dict) -> None:
    """Quantize every decoder Linear's input to float8 e4m3 and back, per token (strategy "token")
    or per token and 128-group (strategy "group"), scale = amax / 448: what W8A8 dynamic means."""
    group = args["group_size"] if args["strategy"] == "group" else None
    fmax = torch.finfo(torch.float8_e4m3fn).max

    def hook(mod, inputs):
        x = inputs[0]
        xs = x.reshape(*x.shape[:-1], -1, group) if group else x.unsqueeze(-2)
        s = xs.abs().amax(-1, keepdim=True) / fmax
        s = torch.where(s == 0, torch.ones_like(s), s)
        q = (xs / s).clamp(-fmax, fmax).to(torch.float8_e4m3fn).to(x.dtype) * s
        return (q.reshape(x.shape),)

    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and not name.endswith("lm_head"):
            mod.register_forward_pre_hook(hook)


def add_int8_activation_quant(model, args: dict) -> None:
    """Quantize every decoder Linear's input to int8 and back, per token, symmetric: scale = amax
    / 127.5 (compressed-tensors' symmetric scale: the half range (127 - -128) / 2), codes
    round-half-even(x / scale) clamped to [-128, 127] (so the amax itself lands on 127)."""
    assert args["strategy"] == "token", args

    def asym_hook(mod, inputs):
        """Asymmetric: the token's range widened to include 0, lo = min(min x, 0) and hi =
        max(max x, 0); scale = (hi - lo) / 255 (eps where 0); zero = round-half-even(-128 - lo /
        scale) clamped to [-128, 127] (compressed-tensors' `calculate_qparams`)."""
        x = inputs[0]
        lo = torch.minimum(x.amin(-1, keepdim=True), torch.zeros((), dtype=x.dtype))
        hi = torch.maximum(x.amax(-1, keepdim=True), torch.zeros((), dtype=x.dtype))
        s = (hi - lo) / 255.0
        s = torch.where(s == 0, torch.full_like(s, torch.finfo(x.dtype).eps), s)
        zero = torch.round((-128 - lo / s).clamp(-128, 127))
        return (asym_int8(x, s, zero),)

    def hook(mod, inputs):
        x = inputs[0]
        s = x.abs().amax(-1, keepdim=True) / 127.5
        s = torch.where(s == 0, torch.full_like(s, torch.finfo(x.dtype).eps), s)
        return (torch.round(x / s).clamp(-128, 127) * s,)

    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and not name.endswith("lm_head"):
            mod.register_forward_pre_hook(hook if args["symmetric"] else asym_hook)


def add_fp4_activation_quant(model, args: dict, tensors: dict[str, torch.Tensor]) -> None:
    """NVFP4 activations (W4A4): every decoder Linear's input quantized and dequantized by
    compressed-tensors' own functions (its dynamic per-16 scales with the layer's calibrated
    `input_global_scale`), in float32; MXFP8's (E8M0 exponents per 32 inputs, no global scale) the same way."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    qargs = QuantizationArgs(**args)
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and not name.endswith("lm_head"):
            glob = tensors[name + ".input_global_scale"].float() if name + ".input_global_scale" in tensors else None

            def hook(mod, inputs, glob=glob):
                x = inputs[0]
                scale, zero = compute_dynamic_scales_and_zp(value=x, args=qargs, module=mod, global_scale=glob)
                return (fake_quantize(x, scale, zero, qargs, global_scale=glob),)

            mod.register_forward_pre_hook(hook)


def add_static_int8_activation_quant(model, tensors: dict[str, torch.Tensor]) -> None:
    """Quantize every decoder Linear's input to int8 and back with the checkpoint's one
    `input_scale` of that layer: round-half-even(x / scale) clamped to [-128, 127], times scale;
    with its `input_zero_point` (asymmetric), as `asym_int8`."""
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and not name.endswith("lm_head"):
            scale = tensors[name + ".input_scale"].float()
            zero = tensors.get(name + ".input_zero_point", torch.zeros(1)).float()

            def hook(mod, inputs, scale=scale, zero=zero):
                return (asym_int8(inputs[0], scale, zero),)

            mod.register_forward_pre_hook(hook)


def loading_config(d: Path):
    """GPTQ / AWQ through GPTQModel's torch kernels (float16 math; its default CPU kernels use
    bfloat16 int4 matmuls, 0.2-0.5 off in the logits here)."""
    qcfg = json.loads((d / "config.json").read_text()).get("quantization_config") or {}
    if qcfg.get("quant_method") == "gptq":
        from transformers import GPTQConfig

        return GPTQConfig(bits=qcfg["bits"], backend="torch")
    if qcfg.get("quant_method") == "awq":
        from transformers import AwqConfig

        return AwqConfig(bits=qcfg["bits"], backend="torch_awq")
    return None


def run(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        logits = model(ids[None]).logits[0].float()
        gen = model.generate(ids[None], do_sample=False, max_new_tokens=GREEDY_TOKENS, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return logits, gen[0, len(ids) :]


def versions() -> str:
    import importlib.metadata as md

    out = [f"torch {torch.__version__}"]
    for pkg in ("transformers", "compressed-tensors", "gptqmodel", "optimum", "nvidia-modelopt"):
        try:
            out.append(f"{pkg} {md.version(pkg)}")
        except md.PackageNotFoundError:
            pass
    return ", ".join(out)


def main() -> None:
    import os
    import tempfile

    # GPTQModel (where installed) sizes its CPU pool from half the cores and writes ./logs.
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
    os.chdir(tempfile.mkdtemp(prefix="quant-references-"))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    args = sys.argv[1:]
    write = "--write" in args
    names = [a for a in args if a != "--write"]
    tok = AutoTokenizer.from_pretrained(HERE / "fp32-source")
    ids = torch.tensor([1] + tok.encode(PROMPT, add_special_tokens=False))
    print("versions:", versions())
    for name in names:
        d = HERE / name
        if (json.loads((d / "config.json").read_text()).get("quantization_config") or {}).get("quant_method") == "modelopt":
            modelopt_reference(d, name, ids, write)
            continue
        qc = loading_config(d)
        kw = {"quantization_config": qc} if qc is not None else {}
        # compressed-tensors decompresses NVFP4 / MXFP4 weights to bfloat16 (a float32 model fails
        # on the dtypes): transformers runs those fixtures in bfloat16.
        fp4 = (json.loads((d / "config.json").read_text()).get("quantization_config") or {}).get("format") in \
            ("nvfp4-pack-quantized", "mxfp4-pack-quantized", "mxfp8-quantized")
        try:
            model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16 if fp4 else torch.float32,
                                                         device_map="cpu", **kw).eval()
        except Exception as e:  # noqa: BLE001 - the report says which fixtures load
            print(f"{name}: transformers cannot load it: {type(e).__name__}: {str(e)[:300]}")
            continue
        hf_logits, hf_greedy = run(model, ids)
        ref_model = dequantized_model(d)
        meaning = "dequantized fp32 weights"
        if (act := activation_args(d)) is not None:
            add_activation_quant(ref_model, act, d)
            mx = act.get("scale_dtype") == "torch.uint8"
            kind = "int8" if act["type"] == "int" else f"mxfp{act['num_bits']}" if mx else \
                "fp8 e4m3" if act["num_bits"] == 8 else "nvfp4"
            how = ("dynamic" if act["dynamic"] else "static") + ("" if act["symmetric"] else " asymmetric")
            meaning += f" + {kind} {how} activations per {act['strategy']}"
        ref_logits, ref_greedy = run(ref_model, ids)
        diff = (hf_logits - ref_logits).abs().max().item()
        top2 = hf_logits.topk(2, -1).values
        margin = (top2[:, 0] - top2[:, 1]).min().item()
        same = torch.equal(hf_greedy, ref_greedy)
        print(f"{name}: max |logits - ({meaning})| = {diff:.3g} (logit scale {hf_logits.abs().max():.3g}), min top-2 margin {margin:.3g}, greedy equal: {same}")
        if write:
            meta = {
                "producer": f"transformers AutoModelForCausalLM.from_pretrained(dtype={'bfloat16' if fp4 else 'float32'}, "
                            f"CPU): {versions()}",
                "prompt": PROMPT,
                "loading_config": repr(qc.to_dict()) if qc is not None else "default",
                "compared_with": meaning,
                "max_abs_diff": f"{diff:.6g}",
                "greedy_equal": str(same),
            }
            tensors = {"input_ids": ids.clone(), "logits": hf_logits.contiguous(), "greedy_ids": hf_greedy.clone()}
            if fp4 or json.loads((d / "config.json").read_text()).get("quantization_config", {}).get(
                    "quant_method") == "bitsandbytes":
                # transformers' CPU 4-bit matmul is not the dequantized weights' product (0.03 off
                # per layer here), nor is its 8-bit one (LLM.int8: int8 activations, outlier
                # columns in float16): keep the logits of the weights bitsandbytes dequantizes too.
                # NVFP4, MXFP4 and MXFP8: transformers' are bfloat16 ones (compressed-tensors
                # decompresses them to bfloat16); keep the float32 dequantized model's, and its
                # greedy tokens (bfloat16's may part from them where two logits nearly tie).
                tensors["dequantized_logits"] = ref_logits.contiguous()
                tensors["dequantized_greedy_ids"] = ref_greedy.clone()
            save_file(tensors, str(d / "reference.safetensors"), metadata=meta)


def add_modelopt_fp8_activation_quant(model, tensors: dict[str, torch.Tensor]) -> None:
    """ModelOpt's FP8 layers' static activations: every such Linear's input quantized to float8
    e4m3 and back by ModelOpt's own `fp8_eager` with the amax its `input_scale` stands for
    (input_scale = amax / 448)."""
    from modelopt.torch.quantization.tensor_quant import fp8_eager

    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name + ".input_scale" in tensors and \
                tensors[name + ".weight"].dtype == torch.float8_e4m3fn:
            amax = tensors[name + ".input_scale"].float() * 448.0

            def hook(mod, inputs, amax=amax):
                return (fp8_eager(inputs[0].float(), amax),)

            mod.register_forward_pre_hook(hook)


def add_modelopt_mxfp8_activation_quant(model, tensors: dict[str, torch.Tensor]) -> None:
    """ModelOpt's MXFP8 activations: every MXFP8 Linear's input quantized per 32 inputs (its
    E8M0 exponent from the block's amax) and dequantized by `MXFP8QTensor.quantize` / `dequantize`."""
    from modelopt.torch.quantization.qtensor.mxfp8_tensor import MXFP8QTensor

    def hook(mod, inputs):
        x = inputs[0].float()
        q, scale = MXFP8QTensor.quantize(x)
        return (q.dequantize(dtype=torch.float32, scale=scale),)

    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and tensors.get(name + ".weight_scale", torch.empty(0)).dtype == torch.uint8:
            mod.register_forward_pre_hook(hook)


def modelopt_reference(d: Path, name: str, ids: torch.Tensor, write: bool) -> None:
    """transformers has no ModelOpt integration: the reference is ModelOpt's own arithmetic, the
    float32 model of the weights its readers dequantize, with its FP4 activation quantization
    where an NVFP4 layer has an `input_scale` (W4A4) and its FP8 one where an FP8 layer has."""
    model = dequantized_model(d)
    tensors = load_tensors(d)
    w4a4 = any(k.endswith(".input_scale") and k.replace("input_scale", "weight_scale_2") in tensors for k in tensors)
    fp8 = any(v.dtype == torch.float8_e4m3fn and k.endswith(".weight") and k.replace(".weight", ".input_scale") in tensors
              for k, v in tensors.items())
    mx = any(k.endswith(".weight_scale") and v.dtype == torch.uint8 for k, v in tensors.items())
    awq = any(k.endswith(".pre_quant_scale") for k in tensors)
    if awq:  # AWQ's smoothing: each such Linear's input times its pre_quant_scale (ModelOpt's order)
        for module_name, mod in model.named_modules():
            if module_name + ".pre_quant_scale" in tensors:
                pqs = tensors[module_name + ".pre_quant_scale"].float()
                mod.register_forward_pre_hook(lambda mod, inputs, pqs=pqs: (inputs[0] * pqs,))
    meaning = "ModelOpt's dequantized fp32 weights" + (" + its NVFP4 activation fake quantization" if w4a4 else "") + (
        " + its FP8 activation fake quantization (static)" if fp8 else "") + (
        " + its MXFP8 activation fake quantization" if mx else "") + (
        " + its AWQ pre_quant_scale on the inputs" if awq else "")
    if mx:
        add_modelopt_mxfp8_activation_quant(model, tensors)
    if w4a4:
        add_modelopt_fp4_activation_quant(model, tensors)
    if fp8:
        add_modelopt_fp8_activation_quant(model, tensors)
    logits, greedy = run(model, ids)
    print(f"{name}: {meaning}: logit scale {logits.abs().max():.3g}, greedy {greedy.tolist()}")
    if write:
        meta = {"producer": f"ModelOpt's reading, float32, CPU: {versions()}", "prompt": PROMPT,
                "compared_with": meaning}
        save_file({"input_ids": ids.clone(), "logits": logits.contiguous(), "greedy_ids": greedy.clone(),
                   "dequantized_logits": logits.clone()}, str(d / "reference.safetensors"), metadata=meta)


if __name__ == "__main__":
    main()
