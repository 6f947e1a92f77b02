"""The quantized formats' tensors, read back to the weights they mean.

A quantized linear layer is stored as several tensors under its module name (its prefix):
- fp8 (transformers' FineGrainedFP8 / DeepSeek-V3, Qwen3-FP8; older per-tensor FP8): `weight`
  (float8) and `weight_scale_inv` (one per block of `weight_block_size`) or `weight_scale`
  (one per tensor); W = weight * scale of its block. FP8 weights whose inputs stay float
  (ModelOpt's FP8_PB_WO, compressed-tensors without input activations) are `fp8wo`
  (`fp8_weight_only.py`: 8-bit codes through the FP8 table, as the packed layers run them);
  with uint8 E8M0 exponents per 32 inputs as `weight_scale`, MXFP8 (`mxfp8.py`).
- ModelOpt int4 (`W4A16_AWQ`, `modelopt_int4.py`): `weight` uint8 [N / 2, K] (two signed codes a
  byte along N), float32 `weight_scale` [N, K / G], AWQ's `pre_quant_scale` [K] on some inputs.
- compressed-tensors (llm-compressor): `weight` (float8 or int8) with `weight_scale` (per tensor
  [1], per channel [N, 1], per group [N, K/G] or per block) and an optional `weight_zero_point`;
  or, pack-quantized, `weight_packed` (int32 [N, K/8] or [N, K/4]: 8 4-bit or 4 8-bit values along
  K, each + 2^(bits-1) so it is unsigned, the first in the lowest bits), `weight_shape`, `weight_scale` [N, K/G] and for
  asymmetric schemes `weight_zero_point` (packed along N the same way); `weight_g_idx` for
  activation-ordered groups. W = (q - zero) * scale. NVFP4 (`nvfp4-pack-quantized`):
  `weight_packed` FP4 codes, `weight_scale` FP8 per 16 inputs, `weight_global_scale` (`nvfp4.py`,
  which reads ModelOpt's NVFP4 too: `weight`, `weight_scale`, `weight_scale_2`);
  MXFP4 (`mxfp4-pack-quantized`): the same codes, a uint8 E8M0 `weight_scale` per 32 (`mxfp4.py`).
- GPTQ (AutoGPTQ, GPTQModel): `qweight` int32 [K/8, N] (packed along K, the first row in the
  lowest bits), `qzeros` int32 [K/G, N/8] (packed along N; `checkpoint_format` gptq stores
  zero - 1), `scales` [K/G, N], `g_idx` [K] (each input row's group). W^T = (q - zero) * scale.
- AWQ (AutoAWQ, GEMM): `qweight` int32 [K, N/8] and `qzeros` int32 [K/G, N/8], both packed along
  N in AWQ's interleaved order (the j-th value of a word is column `AWQ_ORDER[j]` of its 8),
  `scales` [K/G, N]. W^T = (q - zero) * scale.
- bitsandbytes (`bnb.py`): 4-bit (NF4 / FP4), `weight` packed two codes a byte with its quant
  state, W = codebook[q] * scale of its block (a row's blocks of `blocksize` inputs are groups,
  no zeros, where K is a multiple of blocksize); 8-bit (LLM.int8), an int8 `weight` and its
  rows' `SCB`, W = weight * SCB / 127.

`find_linears` names every quantized layer of a checkpoint and the tensors it consumes;
`dequantize` gives its weight as nn.Linear holds it ([N, K], float32, exact: every format's
value times its scale is one float32 rounding of the float64 product). A layer's static
activation parameters (`input_scale`, `input_zero_point`) are among its members: the W8A8 layers
kept quantized read them (resident.py); a dequantized layer leaves them unused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from batonlm.model_runner.checkpoint import Checkpoint
from batonlm.model_runner.quantization import bnb, fp8_weight_only, modelopt_int4, mxfp4, mxfp8, nvfp4
from batonlm.model_runner.quantization.config import QuantConfig, QuantizationError
from batonlm.model_runner.quantization.int_weights import IntWeights, awq_columns, unpack_words

_ACTIVATION_PARAMS = ("input_scale", "input_zero_point", "pre_quant_scale")
_FP8_DTYPES = ("F8_E4M3", "F8_E5M2")


@dataclass(frozen=True)
class QuantizedLinear:
    """One quantized layer: its module name, its storage (fp8, fp8wo: FP8 weight-only, int: an
    unpacked integer weight with scales, packed: compressed-tensors' packed int, gptq, awq, bnb4,
    bnb8, nvfp4, mxfp4, mxfp8, moint4), the checkpoint tensors it
    consumes, and its float weight's shape [N, K]."""

    prefix: str
    storage: str
    members: tuple[str, ...]
    shape: tuple[int, int]


def find_linears(ckpt: Checkpoint, quant: QuantConfig) -> dict[str, QuantizedLinear]:
    """`<prefix>.weight` -> the quantized layer stored under `prefix`, for every quantized layer
    of the checkpoint (a layer left in float is not one)."""
    names = set(ckpt.names())
    out: dict[str, QuantizedLinear] = {}
    for name in sorted(names):
        prefix, _, leaf = name.rpartition(".")
        found = _linear(ckpt, names, prefix, leaf, quant)
        if found is not None:
            out[f"{prefix}.weight"] = found
    return out


def _with_activation_params(names: set[str], prefix: str, members: list[str]) -> tuple[str, ...]:
    return tuple(members + [f"{prefix}.{p}" for p in _ACTIVATION_PARAMS if f"{prefix}.{p}" in names])


def _linear(ckpt: Checkpoint, names: set[str], prefix: str, leaf: str, quant: QuantConfig) -> QuantizedLinear | None:
    p = f"{prefix}."
    if quant.method == "bitsandbytes":
        state = bnb.state_name(names, prefix) if leaf == "weight" else None
        if state is None:
            eight = bnb.int8_members(names, prefix) if leaf == "weight" else None
            if eight is None:
                return None
            rows, cols = ckpt.shape(f"{prefix}.weight")
            return QuantizedLinear(prefix, "bnb8", eight, (rows, cols))
        n, k = (int(v) for v in bnb.quant_state(ckpt, state)["shape"])
        return QuantizedLinear(prefix, "bnb4", bnb.members(names, prefix, state), (n, k))
    if quant.method in ("gptq", "awq") and leaf == "qweight":
        members = [p + "qweight", p + "qzeros", p + "scales"] + ([p + "g_idx"] if p + "g_idx" in names else [])
        absent = [m for m in members if m not in names]
        if absent:
            raise QuantizationError(f"{quant.method} layer {prefix} lacks {', '.join(absent)}")
        packed = ckpt.shape(p + "qweight")
        per_word = 32 // quant.bits
        shape = ((packed[1], packed[0] * per_word) if quant.method == "gptq" else (packed[1] * per_word, packed[0]))
        return QuantizedLinear(prefix, quant.method, tuple(members), shape)
    if leaf in ("weight_packed", "weight") and (fp4 := nvfp4.members(names, prefix)) is not None:
        rows, half = ckpt.shape(fp4[0])  # (ModelOpt's codes are its `weight`)
        return QuantizedLinear(prefix, "nvfp4", fp4, (rows, 2 * half))
    if leaf == "weight_packed" and ckpt.dtype(p + "weight_packed") == "U8" and p + "weight_scale" in names and \
            ckpt.dtype(p + "weight_scale") == "U8":  # MXFP4: FP4 codes with E8M0 exponents
        rows, half = ckpt.shape(p + "weight_packed")
        return QuantizedLinear(prefix, "mxfp4", mxfp4.members(names, prefix), (rows, 2 * half))
    if leaf == "weight_packed":
        members = [m for m in (p + "weight_packed", p + "weight_shape", p + "weight_scale", p + "weight_zero_point",
                               p + "weight_g_idx") if m in names]
        if p + "weight_scale" not in names or p + "weight_shape" not in names:
            raise QuantizationError(f"compressed-tensors layer {prefix} lacks weight_scale or weight_shape")
        n, k = (int(v) for v in ckpt.get(p + "weight_shape").tolist())
        return QuantizedLinear(prefix, "packed", _with_activation_params(names, prefix, members), (n, k))
    if leaf == "weight" and quant.method == "modelopt" and modelopt_int4.is_int4(ckpt, names, prefix):
        return QuantizedLinear(prefix, "moint4", _with_activation_params(names, prefix, [p + "weight", p + "weight_scale"]),
                               modelopt_int4.shape(ckpt, prefix))
    if leaf == "weight" and (p + "weight_scale" in names or p + "weight_scale_inv" in names):
        dtype = ckpt.dtype(name := p + "weight")
        storage = "fp8" if dtype in _FP8_DTYPES else "int" if dtype in ("I8", "U8") else None
        if dtype == "U8" and ckpt.dtype(p + "weight_scale") in _FP8_DTYPES:  # FP4 codes, float8 scales: NVFP4's
            raise QuantizationError(f"{name}: FP4 codes with float8 scales (NVFP4) but no weight_scale_2 or "
                                    "weight_global_scale, the per-tensor scale")
        if storage is None:
            raise QuantizationError(f"{name} has scales but is stored as {dtype}, neither fp8 nor int8")
        scale = p + "weight_scale_inv" if p + "weight_scale_inv" in names else p + "weight_scale"
        members = [name, scale] + [m for m in (p + "weight_zero_point", p + "weight_g_idx") if m in names]
        rows, cols = ckpt.shape(name)
        if storage == "fp8" and ckpt.dtype(scale) == "U8":
            storage = "mxfp8"  # E8M0 exponents per 32 inputs: 8-bit codes through the FP8 table
        elif storage == "fp8" and fp8_weight_only.weight_only(ckpt, names, prefix, scale, quant, rows):
            storage = "fp8wo"  # its inputs stay float (W8A16): 8-bit codes through the FP8 table
        return QuantizedLinear(prefix, storage, _with_activation_params(names, prefix, members), (rows, cols))
    return None


def dequantize(ckpt: Checkpoint, lin: QuantizedLinear, quant: QuantConfig) -> torch.Tensor:
    """The layer's weight [N, K] in float32; with AWQ's `pre_quant_scale` (ModelOpt's int4, which
    multiplies the input by it) its columns times it: the same product, rounded in another order."""
    w = _DEQUANTIZE[lin.storage](ckpt, lin, quant)
    pqs = f"{lin.prefix}.pre_quant_scale"
    return w * ckpt.get(pqs).to(torch.float32)[None, :] if pqs in lin.members else w


def _scaled(ckpt: Checkpoint, lin: QuantizedLinear, quant: QuantConfig) -> torch.Tensor:
    """fp8 or int8 values with a per-tensor, -channel, -group or -block scale (and zero)."""
    p = f"{lin.prefix}."
    n, k = lin.shape
    scale_name = lin.members[1]
    w = ckpt.get(p + "weight").to(torch.float32)
    if p + "weight_zero_point" in lin.members:
        zero = ckpt.get(p + "weight_zero_point").to(torch.float32)
        w = w - _expand(zero, n, k, quant, p + "weight_zero_point")
    return w * _expand(ckpt.get(scale_name).to(torch.float32), n, k, quant, scale_name)


def int_layout(ckpt: Checkpoint, lin: QuantizedLinear, quant: QuantConfig) -> tuple[int, int | None, int]:
    """A GPTQ, AWQ, compressed-tensors packed or bitsandbytes 4-bit layer's (bits, group size in
    rows: -1 for one group, None for activation-ordered groups (or bitsandbytes blocks that cross
    rows), number of groups), read from the tensors' shapes and its group index alone, never
    unpacking its values (what `int_weights` says)."""
    p = f"{lin.prefix}."
    k = lin.shape[1]
    if lin.storage == "int":  # unpacked int8 (bits 0: scales the packed layout cannot take)
        num_groups = _int8_groups(ckpt, lin)
        if not num_groups:
            return 0, -1, 1
        if num_groups == 1:
            return 8, -1, 1
        size = -(-k // num_groups)
        groups = _group_index(ckpt, p + "weight_g_idx", lin, k, num_groups, size)
        return 8, size if torch.equal(groups, torch.arange(k) // size) else None, num_groups
    if lin.storage == "fp8wo":
        return fp8_weight_only.layout(ckpt, lin.members[1], lin.shape, quant)
    if lin.storage == "mxfp8":
        return 8, mxfp8.GROUP, -(-k // mxfp8.GROUP)
    if lin.storage == "moint4":
        return modelopt_int4.layout(ckpt, lin.prefix)
    if lin.storage in ("nvfp4", "mxfp4"):
        size = nvfp4.GROUP if lin.storage == "nvfp4" else mxfp4.GROUP
        return 4, size, -(-k // size)
    if lin.storage == "bnb4":  # a row's blocks are its groups where it holds whole ones (no g_idx: else dequantized)
        size = bnb.blocksize(ckpt, lin.members[1])
        if k % size:
            return 4, None, 0
        return (4, -1, 1) if size == k else (4, size, k // size)
    if lin.storage == "packed":
        packed = ckpt.shape(p + "weight_packed")
        bits = next((b for b in (4, 8) if -(-k * b // 32) == packed[1]), 0)
        num_groups, g_idx = ckpt.shape(p + "weight_scale")[1], p + "weight_g_idx"
    else:
        bits = quant.bits if lin.storage == "gptq" else 4
        num_groups, g_idx = ckpt.shape(p + "scales")[0], p + "g_idx"
    if num_groups == 1:
        return bits, -1, 1
    groups = _group_index(ckpt, g_idx if lin.storage != "awq" else None, lin, k, num_groups, quant.group_size)
    size = -(-k // num_groups)
    return bits, size if torch.equal(groups, torch.arange(k) // size) else None, num_groups


def group_index_name(lin: QuantizedLinear) -> str | None:
    """The checkpoint tensor holding a layer's activation order (each input row's group), if any."""
    name = f"{lin.prefix}.{'weight_g_idx' if lin.storage in ('packed', 'int') else 'g_idx'}"
    return name if name in lin.members else None


def int_weights(ckpt: Checkpoint, lin: QuantizedLinear, quant: QuantConfig) -> IntWeights:
    """A GPTQ, AWQ, compressed-tensors packed or bitsandbytes 4-bit layer's integers, scales and
    groups (and codebook)."""
    return _INT_READERS[lin.storage](ckpt, lin, quant)


def _packed(ckpt: Checkpoint, lin: QuantizedLinear, quant: QuantConfig) -> IntWeights:
    """compressed-tensors' pack-quantized int4 or int8: unsigned values (signed + 2^(bits-1))
    along K, their bit width told by the packed shape."""
    p = f"{lin.prefix}."
    n, k = lin.shape
    packed = ckpt.get(p + "weight_packed")
    bits = next((b for b in (4, 8) if -(-k * b // 32) == packed.shape[1]), None)
    if bits is None:
        raise QuantizationError(f"{p}weight_packed of shape {tuple(packed.shape)} packs {k} input features in "
                                "neither 4 nor 8 bits")
    offset = 1 << (bits - 1)
    q = unpack_words(packed, bits, dim=1)[:, :k].t()
    scale = ckpt.get(p + "weight_scale").to(torch.float32)
    groups = _group_index(ckpt, p + "weight_g_idx", lin, k, scale.shape[1], quant.group_size)
    if p + "weight_zero_point" not in lin.members:  # symmetric: a zero of 0, offset unsigned
        zero = torch.full((scale.shape[1], n), offset, dtype=torch.int32)
    else:
        z = ckpt.get(p + "weight_zero_point")
        zero = (unpack_words(z, bits, dim=0)[:n] if z.dtype == torch.int32 else z.to(torch.int32) + offset).t()
    return IntWeights(q, zero, scale.t(), groups, bits)


def _gptq(ckpt: Checkpoint, lin: QuantizedLinear, quant: QuantConfig) -> IntWeights:
    p = f"{lin.prefix}."
    n, k = lin.shape
    q = unpack_words(ckpt.get(p + "qweight"), quant.bits, dim=0)[:k]  # [K, N]
    words = ckpt.get(p + "qzeros")
    if quant.checkpoint_format == "gptq":
        # v1 stores each word minus 0x11111111 (4-bit), subtracted as one 32-bit word: a zero of
        # 0 borrows from its neighbour, so the whole word is added back before unpacking.
        ones = sum(1 << (quant.bits * i) for i in range(32 // quant.bits))
        words = ((words.to(torch.int64) + ones) & 0xFFFFFFFF).to(torch.int32)
    zeros = unpack_words(words, quant.bits, dim=1)[:, :n]  # [K/G, N]
    scales = ckpt.get(p + "scales").to(torch.float32)
    groups = _group_index(ckpt, p + "g_idx", lin, k, scales.shape[0], quant.group_size)
    return IntWeights(q, zeros, scales, groups, quant.bits)


def _awq(ckpt: Checkpoint, lin: QuantizedLinear, quant: QuantConfig) -> IntWeights:
    p = f"{lin.prefix}."
    n, k = lin.shape
    q = awq_columns(unpack_words(ckpt.get(p + "qweight"), 4, dim=1))[:, :n]  # [K, N]
    zeros = awq_columns(unpack_words(ckpt.get(p + "qzeros"), 4, dim=1))[:, :n]
    scales = ckpt.get(p + "scales").to(torch.float32)
    groups = _group_index(ckpt, None, lin, k, scales.shape[0], quant.group_size)
    return IntWeights(q, zeros, scales, groups, 4)


def _int8_groups(ckpt: Checkpoint, lin: QuantizedLinear) -> int:
    """An unpacked int8 layer's scale groups along K (1: per tensor or channel), or 0 where its
    scales are not per tensor, channel or group (blocks) or its codes are not signed int8."""
    n, k = lin.shape
    scale = tuple(ckpt.shape(lin.members[1]))
    if ckpt.dtype(f"{lin.prefix}.weight") != "I8":
        return 0
    if math.prod(scale) == 1 or scale in ((n,), (n, 1)):
        return 1
    if len(scale) != 2 or scale[0] != n:
        return 0
    groups = scale[1]
    size = -(-k // groups)
    return groups if -(-k // size) == groups else 0  # groups of `size` rows, the last one partial


def _int8(ckpt: Checkpoint, lin: QuantizedLinear, quant: QuantConfig) -> IntWeights:
    """compressed-tensors' int-quantized int8 weights read as weight-only (their activations not
    int8: W8A16): signed codes offset to unsigned (+128), a zero of 128 (+ the zero point), a
    scale per tensor, channel or group (consecutive rows, or in activation order: `weight_g_idx`)."""
    p = f"{lin.prefix}."
    n, k = lin.shape
    num_groups = _int8_groups(ckpt, lin)
    if not num_groups:
        raise QuantizationError(f"{p}weight: int8 codes with scales per tensor, channel or group are read as "
                                "packed integers; this layer's are not")

    def per_row(t: torch.Tensor) -> torch.Tensor:  # per tensor, channel or group -> [N, G]
        return (t.reshape(-1, num_groups) if t.numel() > 1 else t.reshape(1, 1)).expand(n, num_groups)

    q = (ckpt.get(p + "weight").to(torch.int32) + 128).t()  # [K, N]
    scale = per_row(ckpt.get(lin.members[1]).to(torch.float32))
    zero = torch.full((n, num_groups), 128, dtype=torch.int32)
    if p + "weight_zero_point" in lin.members:
        zero = zero + per_row(ckpt.get(p + "weight_zero_point").to(torch.int32))
    groups = _group_index(ckpt, p + "weight_g_idx", lin, k, num_groups, -1 if num_groups == 1 else -(-k // num_groups))
    return IntWeights(q.contiguous(), zero.t().contiguous(), scale.t().contiguous(), groups, 8)


def _bnb4_ints(ckpt: Checkpoint, lin: QuantizedLinear, quant: QuantConfig) -> IntWeights:
    return bnb.int4_weights(ckpt, lin.prefix, lin.members[1])


def _nvfp4_ints(ckpt: Checkpoint, lin: QuantizedLinear, quant: QuantConfig) -> IntWeights:
    return nvfp4.int_weights(ckpt, lin.prefix, lin.shape, lin.members)


def _mxfp4_ints(ckpt: Checkpoint, lin: QuantizedLinear, quant: QuantConfig) -> IntWeights:
    return mxfp4.int_weights(ckpt, lin.prefix, lin.shape)


def _fp8_ints(ckpt: Checkpoint, lin: QuantizedLinear, quant: QuantConfig) -> IntWeights:
    return fp8_weight_only.int_weights(ckpt, lin.prefix, lin.members[1], lin.shape, quant)


def _mxfp8_ints(ckpt: Checkpoint, lin: QuantizedLinear, quant: QuantConfig) -> IntWeights:
    return mxfp8.int_weights(ckpt, lin.prefix, lin.shape)


def codebook_of(ckpt: Checkpoint, lin: QuantizedLinear) -> torch.Tensor | None:
    """A layer's codebook (bitsandbytes' `quant_map`, NVFP4's E2M1 values, weight-only FP8's
    values), or None: its codes are integers."""
    if lin.storage in ("fp8wo", "mxfp8"):
        return fp8_weight_only.codebook(ckpt.dtype(lin.members[0]))
    if lin.storage in ("nvfp4", "mxfp4"):
        return nvfp4.CODEBOOK
    return ckpt.get(f"{lin.prefix}.weight.quant_map").to(torch.float32) if lin.storage == "bnb4" else None


_INT_READERS = {"packed": _packed, "gptq": _gptq, "awq": _awq, "int": _int8, "bnb4": _bnb4_ints, "nvfp4": _nvfp4_ints,
                "mxfp4": _mxfp4_ints, "fp8wo": _fp8_ints, "mxfp8": _mxfp8_ints,
                "moint4": lambda ckpt, lin, quant: modelopt_int4.int_weights(ckpt, lin.prefix)}


def _int_dense(ckpt: Checkpoint, lin: QuantizedLinear, quant: QuantConfig) -> torch.Tensor:
    return int_weights(ckpt, lin, quant).dense()


def _int_scaled(ckpt: Checkpoint, lin: QuantizedLinear, quant: QuantConfig) -> torch.Tensor:
    """Unpacked int8: by its groups in activation order (`weight_g_idx`) where it has them."""
    return _int_dense(ckpt, lin, quant) if group_index_name(lin) else _scaled(ckpt, lin, quant)


def _bnb4(ckpt: Checkpoint, lin: QuantizedLinear, quant: QuantConfig) -> torch.Tensor:
    return bnb.dequantize(ckpt, lin.prefix, lin.members[1])


def _bnb8(ckpt: Checkpoint, lin: QuantizedLinear, quant: QuantConfig) -> torch.Tensor:
    return bnb.dequantize_int8(ckpt, lin.prefix, lin.members)


_DEQUANTIZE = {"fp8": _scaled, "int": _int_scaled, "packed": _int_dense, "gptq": _int_dense, "awq": _int_dense,
               "bnb4": _bnb4, "bnb8": _bnb8, "nvfp4": _int_dense, "mxfp4": _int_dense, "fp8wo": _int_dense,
               "mxfp8": _int_dense, "moint4": _int_dense}


def _group_index(
    ckpt: Checkpoint, g_idx: str | None, lin: QuantizedLinear, k: int, num_groups: int, group_size: int
) -> torch.Tensor:
    """Each input row's group: the checkpoint's `g_idx` when it has one (activation order), else
    row // group size (-1: one group)."""
    if g_idx is not None and g_idx in lin.members:
        groups = ckpt.get(g_idx).to(torch.int64)
        if groups.shape != (k,) or int(groups.min()) < 0 or int(groups.max()) >= num_groups:
            raise QuantizationError(f"{g_idx} is not a group index of {k} rows into {num_groups} groups")
        return groups
    size = k if group_size == -1 else group_size if group_size > 0 else -(-k // num_groups)
    if -(-k // size) != num_groups:
        raise QuantizationError(f"{lin.prefix}: {num_groups} scale groups for {k} input features do not fit the "
                                f"group size {size}")
    return torch.arange(k) // size


def _expand(scale: torch.Tensor, n: int, k: int, quant: QuantConfig, name: str) -> torch.Tensor:
    """A per-tensor, per-channel, per-group or per-block scale (or zero) as a [N, K] (or
    broadcastable) tensor."""
    if scale.numel() == 1:
        return scale.reshape(())
    if scale.dim() == 1 and scale.shape[0] == n:
        return scale[:, None]
    if scale.dim() == 2 and scale.shape == (n, 1):
        return scale
    if scale.dim() == 2 and scale.shape[0] == n:  # per group along K
        size = quant.group_size if quant.group_size > 0 else -(-k // scale.shape[1])
        if -(-k // size) != scale.shape[1]:
            raise QuantizationError(f"{name} has {scale.shape[1]} groups for {k} input features of group size {size}")
        return scale.repeat_interleave(size, dim=1)[:, :k]
    if scale.dim() == 2 and quant.block is not None:
        bn, bk = quant.block
        if scale.shape != (-(-n // bn), -(-k // bk)):
            raise QuantizationError(f"{name} has shape {tuple(scale.shape)}; a [{n}, {k}] weight in {bn}x{bk} blocks "
                                    f"needs {(-(-n // bn), -(-k // bk))}")
        return scale.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    raise QuantizationError(f"{name} of shape {tuple(scale.shape)} is not a per-tensor, per-channel, per-group or "
                            f"per-block scale of a [{n}, {k}] weight")
