"""Write GPTQ and AWQ (GEMM) checkpoints from a float checkpoint, for tests of the quantized loader.

Round-to-nearest quantization of every decoder linear (q/k/v/o/gate/up/down_proj; embeddings,
norms and lm_head stay as they are) into the tensors, dtypes, shapes and bit packing that
AutoGPTQ / GPTQModel (`checkpoint_format: gptq`, the "v1" zeros) and AutoAWQ / GPTQModel
(`version: gemm`) save, with the `quantization_config` they write. The packing is checked against
the tools' own unpacking code by tests/data/quantized/check_packing.py (README.md there) and against
an unpacking written from the formats' descriptions by tests/unit/test_quant_formats.py.

Each writer returns the dequantized float32 weights ({"model.layers.0.self_attn.q_proj.weight":
[N, K], ...}): what the quantized checkpoint means, exactly (scale * (q - zero) with the stored
float16 scale, computed in float32). `save_dequantized` writes them into a plain float32 checkpoint
that transformers loads without any quantization package.

Layouts (K = in_features, N = out_features, G = group_size, W = [N, K] as nn.Linear stores it):

GPTQ, bits b in (2, 4, 8), pack factor f = 32 / b:
  qweight int32 [K / f, N]   qweight[i, n] bits [b*j, b*j + b) = q[n, i*f + j]  (packed along input rows)
  qzeros  int32 [K / G, N / f] qzeros[g, c] bits [b*j, ...) = z[g, c*f + j] - 1  ("v1": zero minus one; see gptq_v1_qzeros)
  scales  float16 [K / G, N]
  g_idx   int32 [K]          the group of input row k (k // G, or by the act order when desc_act)
  W[n, k] = scales[g_idx[k], n] * (q[n, k] - z[g_idx[k], n])

AWQ GEMM, 4 bits:
  qweight int32 [K, N / 8]   nibble i of qweight[k, c] = q[c*8 + AWQ_ORDER[i], k]  (packed along outputs, interleaved)
  qzeros  int32 [K / G, N / 8] same packing of z (no minus one)
  scales  float16 [K / G, N]
  W[n, k] = scales[k // G, n] * (q[n, k] - z[k // G, n])
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a packed word holds output column AWQ_ORDER[i]
AUX_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)


# DeepSeek's latent attention: its projections are FP8 in its released checkpoints too.
MLA_LINEARS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")


def is_quantized_linear(name: str, linears: tuple[str, ...] = LINEARS) -> bool:
    parts = name.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in linears


def load_float_checkpoint(src_dir: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    src = Path(src_dir)
    config = json.loads((src / "config.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    # model.safetensors or model-0000i-of-0000n.safetensors: not reference.safetensors beside them
    for path in sorted(src.glob("model*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for k in f.keys():
                tensors[k] = f.get_tensor(k)
    if not tensors:
        raise FileNotFoundError(f"no safetensors in {src}")
    return config, tensors


# ---------------------------------------------------------------------------------------------
# bit packing


def pack_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] codes in [0, 2^bits) -> int32 [R * bits / 32, C]: word i holds rows i*f .. i*f+f-1,
    row i*f + j in bits [bits*j, bits*j + bits)."""
    f = 32 // bits
    R, C = q.shape
    assert R % f == 0, (R, f)
    q = q.to(torch.int64).reshape(R // f, f, C)
    shifts = (torch.arange(f, dtype=torch.int64) * bits).reshape(1, f, 1)
    words = (q << shifts).sum(dim=1)
    return _to_int32(words)


def pack_cols(q: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """[R, C] codes -> int32 [R, C * bits / 32]: word c holds columns c*f .. c*f+f-1; slot j (bits
    [bits*j, ...)) holds column c*f + order[j] (order: identity, or AWQ's interleave)."""
    f = 32 // bits
    R, C = q.shape
    assert C % f == 0, (C, f)
    q = q.to(torch.int64).reshape(R, C // f, f)
    if order is not None:
        q = q[:, :, list(order)]
    shifts = (torch.arange(f, dtype=torch.int64) * bits).reshape(1, 1, f)
    words = (q << shifts).sum(dim=2)
    return _to_int32(words)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """uint32 values held in int64 -> the int32 with the same bits."""
    words = words & 0xFFFFFFFF
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


# ---------------------------------------------------------------------------------------------
# quantization (round to nearest, as the tools' quantizers compute scales and zeros)


def gptq_quantize(w: torch.Tensor, bits: int, group_size: int, sym: bool, perm: torch.Tensor | None = None):
    """GPTQ's per-group min/max quantizer (AutoGPTQ / GPTQModel `Quantizer.find_params`), applied
    without the Hessian update. Groups run over input columns in `perm` order (desc_act) or in
    order. Returns (q [N, K] int64, scales fp16 [K/G, N], zeros [K/G, N] int64, g_idx [K] int32)."""
    w = w.to(torch.float32)
    N, K = w.shape
    G = group_size if group_size > 0 else K
    assert K % G == 0, (K, G)
    maxq = 2**bits - 1
    order = torch.arange(K) if perm is None else perm
    g_idx = torch.empty(K, dtype=torch.int32)
    g_idx[order] = (torch.arange(K) // G).to(torch.int32)
    n_groups = K // G
    scales = torch.empty(n_groups, N, dtype=torch.float16)
    zeros = torch.empty(n_groups, N, dtype=torch.int64)
    for g in range(n_groups):
        cols = order[g * G : (g + 1) * G]
        x = w[:, cols]
        xmin = torch.minimum(x.min(dim=1).values, torch.zeros(N))
        xmax = torch.maximum(x.max(dim=1).values, torch.zeros(N))
        if sym:
            xmax = torch.maximum(xmin.abs(), xmax)
            xmin = -xmax
        both0 = (xmin == 0) & (xmax == 0)
        xmin[both0], xmax[both0] = -1.0, 1.0
        scale = (xmax - xmin) / maxq
        if sym:
            zero = torch.full((N,), (maxq + 1) // 2, dtype=torch.int64)
        else:
            zero = torch.round(-xmin / scale).to(torch.int64)
        scales[g] = scale.to(torch.float16)
        zeros[g] = zero
    s = scales.to(torch.float32)[g_idx.long()].T  # [N, K]
    z = zeros[g_idx.long()].T
    q = torch.clamp(torch.round(w / s) + z, 0, maxq).to(torch.int64)
    return q, scales, zeros, g_idx


def awq_quantize(w: torch.Tensor, group_size: int, bits: int = 4):
    """AutoAWQ's `pseudo_quantize_tensor` with zero_point=True (without the activation-aware
    scale search). Returns (q [N, K] int64, scales fp16 [K/G, N], zeros [K/G, N] int64)."""
    w = w.to(torch.float32)
    N, K = w.shape
    G = group_size
    assert K % G == 0, (K, G)
    max_int = 2**bits - 1
    x = w.reshape(N, K // G, G)
    max_val = x.amax(dim=2)
    min_val = x.amin(dim=2)
    scale = ((max_val - min_val).clamp(min=1e-5) / max_int).to(torch.float16)  # [N, K/G]
    zero = torch.clamp(-torch.round(min_val / scale.to(torch.float32)), 0, max_int).to(torch.int64)
    s = scale.to(torch.float32).repeat_interleave(G, dim=1)
    z = zero.repeat_interleave(G, dim=1)
    q = torch.clamp(torch.round(w / s) + z, 0, max_int).to(torch.int64)
    return q, scale.T.contiguous(), zero.T.contiguous()


def dequantize(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    """W [N, K] float32 = scales[g_idx[k], n] * (q[n, k] - zeros[g_idx[k], n])."""
    gi = g_idx.long()
    return scales.to(torch.float32)[gi].T * (q - zeros[gi].T).to(torch.float32)


def unpack_rows(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R / f, C] -> codes [R, C] (inverse of pack_rows)."""
    f = 32 // bits
    shifts = (torch.arange(f, dtype=torch.int64) * bits).reshape(1, f, 1)
    codes = (words.to(torch.int64).unsqueeze(1) >> shifts) & (2**bits - 1)
    return codes.reshape(-1, words.shape[1])


def unpack_cols(words: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 [R, C / f] -> codes [R, C] (inverse of pack_cols with the same order)."""
    f = 32 // bits
    shifts = (torch.arange(f, dtype=torch.int64) * bits).reshape(1, 1, f)
    slots = (words.to(torch.int64).unsqueeze(2) >> shifts) & (2**bits - 1)  # [R, C/f, f] by slot
    if order is not None:
        codes = torch.empty_like(slots)
        codes[:, :, list(order)] = slots
        slots = codes
    return slots.reshape(words.shape[0], -1)


def _ones_pattern(bits: int) -> int:
    """1 in every code of a 32-bit word: 0x11111111 for 4 bits."""
    return sum(1 << (bits * j) for j in range(32 // bits))


def gptq_v1_qzeros(zeros: torch.Tensor, bits: int) -> torch.Tensor:
    """Zero points [K/G, N] -> v1 qzeros int32 [K/G, N/f]: the packed zeros minus one in every code,
    subtracted from the whole word as GPTQModel's convert_gptq_v2_to_v1_format_module does. Where
    every zero is >= 1 (always when sym: zero = 2^(bits-1)) this is each code's zero - 1; a zero of
    0 borrows from the next code, which GPTQModel's whole-word +1 on load undoes but a per-code
    reader (zero = code + 1) does not."""
    words = pack_cols(zeros, bits).to(torch.int64) - _ones_pattern(bits)
    return _to_int32(words)


def dequantize_gptq(qweight, qzeros, scales, g_idx, bits: int = 4) -> torch.Tensor:
    """What a GPTQ (checkpoint_format "gptq", v1 zeros) linear means: float32 W [N, K]. Zeros are
    read as GPTQModel reads v1: the whole word plus one in every code, then unpacked."""
    q = unpack_rows(qweight, bits).T  # [N, K]
    zeros = unpack_cols(_to_int32(qzeros.to(torch.int64) + _ones_pattern(bits)), bits)  # [K/G, N]
    return dequantize(q, scales, zeros, g_idx)


def dequantize_awq(qweight, qzeros, scales, group_size: int) -> torch.Tensor:
    """What an AWQ GEMM linear means: float32 W [N, K]."""
    q = unpack_cols(qweight, 4, AWQ_ORDER).T  # [N, K]
    zeros = unpack_cols(qzeros, 4, AWQ_ORDER)  # [K/G, N]
    g_idx = torch.arange(q.shape[1], dtype=torch.int32) // group_size
    return dequantize(q, scales, zeros, g_idx)


# ---------------------------------------------------------------------------------------------
# writers


def _finish(src: Path, out: Path, config: dict, qconfig: dict, tensors: dict[str, torch.Tensor], dtype: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    config = dict(config)
    config["quantization_config"] = qconfig
    config["dtype"] = dtype
    config.pop("torch_dtype", None)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in AUX_FILES:
        if (src / name).exists():
            shutil.copy(src / name, out / name)


def _keep(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype) if t.is_floating_point() else t


def write_gptq_checkpoint(
    src_dir: str | Path,
    out_dir: str | Path,
    bits: int = 4,
    group_size: int = 128,
    sym: bool = True,
    desc_act: bool = False,
    dtype: torch.dtype = torch.bfloat16,
    linears: tuple[str, ...] = LINEARS,
    order_key: Callable[[str], str] | None = None,
) -> dict[str, torch.Tensor]:
    """A GPTQ checkpoint (checkpoint_format "gptq", as AutoGPTQ and GPTQModel save) of every
    decoder linear (`linears`: their names); other tensors are cast to `dtype` (GPTQModel keeps the model's bfloat16;
AutoGPTQ saved float16). Scales are float16 either way, as both tools store them.
    desc_act=True orders each matrix's groups by descending input-column norm (a stand-in for the
    Hessian diagonal GPTQ sorts by), so g_idx is a real permutation of groups; with `order_key`,
    the matrices whose names map to one key share one order (by their summed squared column
    norms), as GPTQ orders the projections of one input (q/k/v, an expert's gate/up) by that
    input's one Hessian. Returns the dequantized float32 weights by name."""
    if bits not in (2, 4, 8):
        raise ValueError(f"bits={bits}: only 2, 4 and 8 pack evenly into int32")
    src, out = Path(src_dir), Path(out_dir)
    config, tensors = load_float_checkpoint(src)
    f = 32 // bits
    result: dict[str, torch.Tensor] = {}
    deq: dict[str, torch.Tensor] = {}
    shared: dict[str, torch.Tensor] = {}  # order key -> summed squared column norms
    if desc_act and order_key is not None:
        for name, t in tensors.items():
            if is_quantized_linear(name, linears):
                key = order_key(name)
                shared[key] = shared.get(key, 0) + t.to(torch.float32).pow(2).sum(dim=0)
    for name, t in tensors.items():
        if not is_quantized_linear(name, linears):
            result[name] = _keep(t, dtype)
            continue
        prefix = name[: -len(".weight")]
        w = t.to(torch.float32)
        N, K = w.shape
        G = group_size if group_size > 0 else K
        if K % G or K % f or N % f:
            raise ValueError(f"{name} {tuple(w.shape)}: not divisible by group {G} / pack factor {f}")
        norms = shared[order_key(name)] if shared and order_key is not None else w.norm(dim=0)
        perm = torch.argsort(norms, descending=True, stable=True) if desc_act else None
        q, scales, zeros, g_idx = gptq_quantize(w, bits, G, sym, perm)
        result[prefix + ".qweight"] = pack_rows(q.T, bits)  # [K/f, N]
        result[prefix + ".qzeros"] = gptq_v1_qzeros(zeros, bits)  # [K/G, N/f]
        result[prefix + ".scales"] = scales  # [K/G, N] fp16
        result[prefix + ".g_idx"] = g_idx  # [K] int32
        deq[name] = dequantize(q, scales, zeros, g_idx)
    qconfig = {
        # The fields GPTQModel 7.6 writes (its "meta" block left out); AutoGPTQ writes the same
        # core (bits, group_size, desc_act, sym, quant_method, checkpoint_format) plus
        # damp_percent / static_groups / true_sequential.
        "bits": bits,
        "checkpoint_format": "gptq",
        "desc_act": desc_act,
        "format": "gptq",
        "group_size": group_size,
        "lm_head": False,
        "method": "gptq",
        "pack_dtype": "int32",
        "quant_method": "gptq",
        "sym": sym,
        "meta": {"quantizer": ["batonlm-tests:quant_formats"], "static_groups": False, "true_sequential": True},
    }
    _finish(src, out, config, qconfig, result, str(dtype).removeprefix("torch."))
    return deq


def write_awq_checkpoint(
    src_dir: str | Path,
    out_dir: str | Path,
    group_size: int = 128,
    zero_point: bool = True,
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, torch.Tensor]:
    """An AWQ GEMM checkpoint (version "gemm", as AutoAWQ and GPTQModel save) of every decoder
    linear, 4 bits. Returns the dequantized float32 weights by name."""
    if not zero_point:
        # AutoAWQ's GEMM packer needs zeros (WQLinear_GEMM.from_linear multiplies by them).
        raise NotImplementedError("AWQ GEMM checkpoints are written with zero_point=True")
    src, out = Path(src_dir), Path(out_dir)
    config, tensors = load_float_checkpoint(src)
    result: dict[str, torch.Tensor] = {}
    deq: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if not is_quantized_linear(name):
            result[name] = _keep(t, dtype)
            continue
        prefix = name[: -len(".weight")]
        w = t.to(torch.float32)
        N, K = w.shape
        if K % group_size or N % 8:
            raise ValueError(f"{name} {tuple(w.shape)}: not divisible by group {group_size} / 8")
        q, scales, zeros = awq_quantize(w, group_size)
        result[prefix + ".qweight"] = pack_cols(q.T, 4, AWQ_ORDER)  # [K, N/8]
        result[prefix + ".qzeros"] = pack_cols(zeros, 4, AWQ_ORDER)  # [K/G, N/8]
        result[prefix + ".scales"] = scales  # [K/G, N] fp16
        g_idx = torch.arange(K, dtype=torch.int32) // group_size
        deq[name] = dequantize(q, scales, zeros, g_idx)
    qconfig = {
        # AutoAWQ's AwqConfig.to_transformers_dict(), field for field.
        "bits": 4,
        "group_size": group_size,
        "modules_to_not_convert": None,
        "quant_method": "awq",
        "version": "gemm",
        "zero_point": zero_point,
    }
    _finish(src, out, config, qconfig, result, str(dtype).removeprefix("torch."))
    return deq


def save_dequantized(quant_dir: str | Path, deq: dict[str, torch.Tensor], dst_dir: str | Path) -> None:
    """A plain float32 checkpoint of what a checkpoint written here means: its unquantized tensors
    (as stored, in float32) and the dequantized linears `deq` a writer returned; transformers
    loads it without any quantization package."""
    src, dst = Path(quant_dir), Path(dst_dir)
    config, tensors = load_float_checkpoint(src)
    out = {k: v.to(torch.float32).contiguous() for k, v in tensors.items()
           if v.is_floating_point() and not k.endswith((".scales", ".weight_scale_inv", ".weight_scale", ".input_scale"))}
    out.update({k: v.to(torch.float32).contiguous() for k, v in deq.items()})
    dst.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in config.items() if k != "quantization_config"}
    config["dtype"] = "float32"
    config.pop("torch_dtype", None)
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for name in AUX_FILES:
        if (src / name).exists():
            shutil.copy(src / name, dst / name)


def write_fp8_block_checkpoint(src_dir: str | Path, out_dir: str | Path, block: tuple[int, int] = (128, 128),
                               linears: tuple[str, ...] = LINEARS) -> dict[str, torch.Tensor]:
    """transformers' FineGrainedFP8 format (DeepSeek-V3, Qwen3-FP8): every decoder linear's weight
    in float8 e4m3 with one float32 `weight_scale_inv` per block of `block` (amax / 448, the
    dequantized weight is weight * its block's scale), `quant_method: fp8`, dynamic activations.
    transformers' own loader reads it back (it dequantizes on a machine without a GPU, to
    bfloat16). `linears`: the projections quantized (a MoE router stays float). Returns the
    dequantized float32 weights."""
    src, out = Path(src_dir), Path(out_dir)
    config, tensors = load_float_checkpoint(src)
    bn, bk = block
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    result: dict[str, torch.Tensor] = {}
    deq: dict[str, torch.Tensor] = {}
    for name, w in tensors.items():
        if not is_quantized_linear(name, linears):
            result[name] = w
            continue
        n, k = w.shape
        rows, cols = -(-n // bn), -(-k // bk)
        padded = torch.zeros(rows * bn, cols * bk, dtype=torch.float32)
        padded[:n, :k] = w.float()
        blocks = padded.view(rows, bn, cols, bk)
        scale = (blocks.abs().amax(dim=(1, 3)) / fp8_max).clamp_min(torch.finfo(torch.float32).tiny)
        q = (blocks / scale[:, None, :, None]).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn)
        result[name] = q.view(rows * bn, cols * bk)[:n, :k].contiguous()
        result[name.removesuffix(".weight") + ".weight_scale_inv"] = scale
        deq[name] = (q.to(torch.float32) * scale[:, None, :, None]).view(rows * bn, cols * bk)[:n, :k].contiguous()
    qconfig = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    _finish(src, out, config, qconfig, result, str(next(iter(tensors.values())).dtype).removeprefix("torch."))
    return deq
