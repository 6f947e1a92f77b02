"""Decode attention over the KV pool on the CPU without gathering the context: a C++ kernel
(`cpu_attention.cpp`) that reads each row's keys and values in place through its KV slots, and
its torch reference (gather, then SDPA: what the CPU step ran before).

At 64 rows of 128 keys the gather copied 268 MB a step out of the 25M shape's pool and SDPA read
it again; the kernel reads it once (docs/benchmarks.md). It is compiled once per machine with the
C++ compiler inductor uses (`-O3 -march=native -fopenmp`, against torch's headers; cached by
source, compiler, torch version and CPU flags) and registers the op
`batonlm::paged_decode_attention` in C++, which the eager step calls and the compiled decode step
traces like any other op. Where no compiler works, `available()` is false and the callers keep
the gather.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F

from batonlm.kernels.toolchain import load_ops

SOURCE = Path(__file__).with_name("cpu_attention.cpp")


def reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, kv_index: torch.Tensor,
              mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, KVH, G, D], pools [KVH, S, D], kv_index and mask [B, L] -> [B, KVH, G, D]: the
    context gathered, then SDPA over it (a row with nothing unmasked gives zeros)."""
    b, kvh, _, d = q.shape
    length = kv_index.shape[1]
    keys = k_pool.index_select(1, kv_index.reshape(-1)).view(kvh, b, length, d).transpose(0, 1)
    values = v_pool.index_select(1, kv_index.reshape(-1)).view(kvh, b, length, d).transpose(0, 1)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None, None, :], scale=scale)
    return torch.where(mask.any(1)[:, None, None, None], out, 0.0)


@functools.cache
def _kernel() -> bool:
    return load_ops(SOURCE, "decode attention gathers the context")


def available() -> bool:
    """Whether the kernel runs here (built, or buildable, on this machine)."""
    return _kernel()


class _Pool(Protocol):
    """What `supports` reads of a KV pool (model_runner.kv_pool.KVPool)."""

    k: list[torch.Tensor]
    latent: bool
    quantized: bool


# Below this head size the gather and SDPA win: the kernel vectorises over a head's dimensions,
# and stories260K's heads of 8 made its compiled step at 16 / 64 rows 1.66 / 5.41 ms against
# 1.03 / 3.01 ms gathering (benchmarks/decode_step.py, one thread); at 64 (the 25M shape) it wins.
MIN_HEAD_DIM = 16


def supports(kv_pool: _Pool, softcap: float | None) -> bool:
    """What the kernel computes, where it pays: keys and values of their own (not a latent),
    stored in float32 on the CPU, heads of MIN_HEAD_DIM or more, no logit soft-capping."""
    k = kv_pool.k[0]
    plain = not kv_pool.latent and not kv_pool.quantized and k.dtype == torch.float32 and k.shape[-1] >= MIN_HEAD_DIM
    return plain and k.device.type == "cpu" and softcap is None and available()


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, kv_index: torch.Tensor,
                     mask: torch.Tensor, scale: float) -> torch.Tensor:
    """`reference`'s result, each key and value read in place (float32, the CPU): the op
    `batonlm::paged_decode_attention`, which the eager step calls and a compiled graph holds
    (where `available()` said yes: else torch names the missing op)."""
    if not torch.compiler.is_compiling():  # loaded on first use (a graph is traced after `available`)
        _kernel()
    return torch.ops.batonlm.paged_decode_attention(q, k_pool, v_pool, kv_index, mask, scale)
