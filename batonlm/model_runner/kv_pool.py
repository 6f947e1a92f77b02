"""Physical KV memory: per-layer, token-granular K and V buffers indexed by KV slot, stored in
the model's dtype or in FP8 (`--kv-cache-dtype`) with a scale per layer."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

# --kv-cache-dtype's FP8 formats (auto: the model's dtype). e4m3: 3 mantissa bits, finite up to
# 448; e5m2: 2 mantissa bits, up to 57344.
KV_CACHE_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP8_DTYPES = frozenset(KV_CACHE_DTYPES.values())


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV pool's storage dtype for `--kv-cache-dtype name` (auto: the model's dtype)."""
    if name == "auto":
        return model_dtype
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"KV cache dtype {name!r} is not supported (supported: auto, {', '.join(KV_CACHE_DTYPES)})")
    return KV_CACHE_DTYPES[name]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Zeros; on the CPU from calloc (numpy's zeros), whose large blocks are fresh zero pages the
    OS commits only when written: the pool's memory counts as the slots used so far, not the
    whole budget (a 25M model's 2 GiB pool is ~0 MB of an idle server's RSS)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


class KVPool:
    """`k[layer][:, slot]` and `v[layer][:, slot]` hold one token's keys/values ([kv_heads, head_dim]).

    Head-major ([kv_heads, slots, head_dim]): gathering a batch's context along the slot axis
    gives [kv_heads, tokens, head_dim] contiguous, the layout attention reads without a copy.
    Slot 0 is never handed out by the allocator: it is the padding target that gathers and
    writes of padded rows point at, so it may hold garbage.

    With an FP8 `cache_dtype` a layer's keys are stored as `k / k_scale[layer]` rounded to FP8,
    clamped to the format's largest finite value (a key beyond it saturates rather than
    becoming inf or NaN), and read back as `stored * k_scale[layer]` in the model's `dtype`;
    values likewise with `v_scale`. The scales are plain floats (float32 values), constants of
    the model: a compiled or captured decode step bakes them in.

    `latent` (multi-head latent attention, models/mla.py): the values are the keys (the latent
    whose first features attention keeps), stored once: `v[layer]` is `k[layer]`, writes store
    the keys, gathers return one tensor twice, and a token costs half the bytes.
    """

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        cache_dtype: torch.dtype | None = None,
        k_scales: Sequence[float] | None = None,
        v_scales: Sequence[float] | None = None,
        latent: bool = False,
    ) -> None:
        self.dtype = dtype  # what `write` takes and `gather` gives
        self.cache_dtype = cache_dtype or dtype  # what the buffers hold
        self.quantized = self.cache_dtype in FP8_DTYPES
        if not self.quantized and (k_scales is not None or v_scales is not None):
            raise ValueError(f"KV scales apply to an FP8 KV cache, not {self.cache_dtype}")
        self.latent = latent
        self.k_scale = _scales(k_scales, num_layers, "k")
        self.v_scale = self.k_scale if latent else _scales(v_scales, num_layers, "v")
        self._max = torch.finfo(self.cache_dtype).max if self.quantized else 0.0
        shape = (num_kv_heads, num_slots, head_dim)
        self.num_slots = num_slots
        self.k = [_zeros(shape, self.cache_dtype, device) for _ in range(num_layers)]
        self.v = self.k if latent else [_zeros(shape, self.cache_dtype, device) for _ in range(num_layers)]

    def _store(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        if not self.quantized:
            return x
        if scale != 1.0:  # one rounding: the quotient in float32, then to FP8
            x = x.to(torch.float32) / scale
        return x.clamp(-self._max, self._max).to(self.cache_dtype)

    def _load(self, stored: torch.Tensor, scale: float) -> torch.Tensor:
        if not self.quantized:
            return stored
        x = stored.to(self.dtype)  # exact: every FP8 value is a float16/bfloat16/float32 value
        return x if scale == 1.0 else x * scale

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [tokens, kv_heads, head_dim] of the tokens going to `slots` (latent: v is k)."""
        self.k[layer][:, slots] = self._store(k, self.k_scale[layer]).transpose(0, 1)
        if self.latent:
            return
        self.v[layer][:, slots] = self._store(v, self.v_scale[layer]).transpose(0, 1)

    def gather(
        self, layer: int, slots: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[kv_heads, len(slots), head_dim] keys and values in the model's dtype (contiguous
        copies, dequantized from FP8), into `out` when given: reusing one buffer for every layer
        saves allocating (and page-faulting) megabytes per layer."""
        keys = self._gather(self.k[layer], self.k_scale[layer], slots, None if out is None else out[0])
        if self.latent:
            return keys, keys
        return keys, self._gather(self.v[layer], self.v_scale[layer], slots, None if out is None else out[1])

    def _gather(self, stored: torch.Tensor, scale: float, slots: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        if out is None:
            return self._load(stored.index_select(1, slots), scale)
        if not self.quantized:
            return torch.index_select(stored, 1, slots, out=out)
        out.copy_(stored.index_select(1, slots))  # the FP8 copy is a quarter of a float32 one
        return out if scale == 1.0 else out.mul_(scale)

    def gather_buffers(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        kvh, _, d = self.k[0].shape
        device = self.k[0].device
        keys = torch.empty((kvh, num_tokens, d), dtype=self.dtype, device=device)
        return (keys, keys if self.latent else torch.empty((kvh, num_tokens, d), dtype=self.dtype, device=device))

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, latent: bool = False
    ) -> int:
        """KV bytes of one token in a pool stored in `dtype` (the cache dtype: 1 byte an element
        in FP8); a latent pool stores its keys only."""
        copies = 1 if latent else 2
        return copies * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def _scales(given: Sequence[float] | None, num_layers: int, kind: str) -> list[float]:
    if given is None:
        return [1.0] * num_layers
    scales = [float(torch.tensor(s, dtype=torch.float32)) for s in given]  # float32 values, as stored
    if len(scales) != num_layers:
        raise ValueError(f"{len(scales)} {kind}_scale values for {num_layers} layers")
    bad = [i for i, s in enumerate(scales) if not (s > 0 and s != float("inf"))]
    if bad:
        raise ValueError(f"{kind}_scale of layer {bad[0]} is {scales[bad[0]]}: a KV scale must be positive and finite")
    return scales
