"""The compiled decode step (CPU): one inductor graph per batch-size bucket.

A decode step over a small model is a few hundred tiny torch ops, and dispatching them costs
more than computing them (stories260K: ~0.85 ms eager per step at batch 1, ~0.33 ms compiled).
`torch.compile` turns the step — embedding, every layer, the final norm and the logits — into
generated C++ for each batch-size bucket. Each row's context is gathered over a context bucket
(a power of two, at least MIN_CONTEXT_BUCKET) with the keys past its length masked out; the
context dimension is compiled dynamic, so one graph serves every context bucket of a batch size.

The attention inside the graph is the torch backend's decode math (gather through the
req-to-token row, one masked SDPA per layer over [kv_heads, B, group, L]); the rest is the
model's own code. Compiled artefacts go to the inductor cache in `cache_dir`: a restart
recompiles nothing (cold and cached start-up times: docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from batonlm.model_runner.attention.base import AttentionBackend
from batonlm.model_runner.decode_graphs import DecodeGraphs, Progress, batch_buckets, smallest_bucket
from batonlm.model_runner.forward_batch import ForwardBatch
from batonlm.model_runner.kv_pool import KVPool
from batonlm.model_runner.req_to_token import ReqToTokenPool

logger = logging.getLogger(__name__)

MIN_CONTEXT_BUCKET = 128


class CompileFailed(RuntimeError):
    """torch.compile could not build the decode step (the caller stays eager)."""


def context_buckets(max_context: int) -> tuple[int, ...]:
    """Powers of two from MIN_CONTEXT_BUCKET; the last one is `max_context` itself."""
    out, n = [], MIN_CONTEXT_BUCKET
    while n < max_context:
        out.append(n)
        n *= 2
    out.append(max_context)
    return tuple(out)


@contextlib.contextmanager
def _quiet_torch_logs():
    """A failed compile is reported in one line by the caller; torch would log its traceback."""
    loggers = [logging.getLogger(name) for name in ("torch._dynamo", "torch._inductor", "torch._guards", "torch.fx")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


class _DecodeInputs(NamedTuple):
    """What the model and the attention read of a padded decode batch (the `batch` they get)."""

    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    attn_metadata: tuple[torch.Tensor, dict[int | None, torch.Tensor]]


class PaddedDecodeAttention(AttentionBackend):
    """Decode attention over [kv_heads, B, L, d] gathered keys with a length mask: every shape
    depends only on the buckets, so the whole step traces into one graph."""

    def metadata(self, req_slots: torch.Tensor, seq_lens: torch.Tensor, key_pos: torch.Tensor):
        b, s = req_slots.shape[0], key_pos.shape[0]
        heads_per_kv = self.num_heads // self.num_kv_heads
        valid = key_pos[None, :] < seq_lens[:, None]  # [B, L]
        # Indexed, not sliced: a slice ending at the table's width would pin the dynamic length.
        kv_index = torch.where(valid, self.req_to_token.table[req_slots[:, None], key_pos[None, :]], 0).reshape(-1)
        query_pos = (seq_lens - 1)[:, None]
        masks = {}
        for window in set(self.sliding_windows):
            m = valid if window is None else valid & (key_pos[None, :] > query_pos - window)
            masks[window] = m[None, :, None, :].expand(1, b, heads_per_kv, s)
        return kv_index, masks

    def prepare(self, batch: ForwardBatch) -> None:
        raise TypeError("PaddedDecodeAttention builds its metadata inside the compiled step")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch) -> torch.Tensor:
        self.kv_pool.write(layer, batch.out_cache_loc, k, v)
        kv_index, masks = batch.attn_metadata
        kvh, d = self.num_kv_heads, self.head_dim
        b = q.shape[0]
        s = kv_index.shape[0] // b
        keys = self.kv_pool.k[layer].index_select(1, kv_index).view(kvh, b, s, d)
        values = self.kv_pool.v[layer].index_select(1, kv_index).view(kvh, b, s, d)
        queries = q.view(b, kvh, -1, d).transpose(0, 1)  # [kvh, B, group, d]
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=masks[self.sliding_windows[layer]], scale=self.scale
        )
        return out.transpose(0, 1).reshape(b, self.num_heads * d)


class CompiledDecode(DecodeGraphs):
    def __init__(
        self,
        model: torch.nn.Module,
        kv_pool: KVPool,
        req_to_token: ReqToTokenPool,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        sliding_windows: tuple[int | None, ...],
        *,
        max_bs: int,
        max_context: int,
        cache_dir: str,
    ) -> None:
        import torch._dynamo

        self.model = model
        self.attn = PaddedDecodeAttention(kv_pool, req_to_token, num_heads, num_kv_heads, head_dim, sliding_windows)
        self.batch_buckets = batch_buckets(max_bs)
        self.max_context = max_context
        self.context_buckets = context_buckets(max_context)
        self.cache_dir = cache_dir
        device = kv_pool.k[0].device
        self._key_pos = {s: torch.arange(s, device=device) for s in self.context_buckets}
        for t in self._key_pos.values():
            torch._dynamo.mark_dynamic(t, 0)  # one graph per batch size, whatever the context
        self._step: Callable[..., torch.Tensor] | None = None

    def _forward(self, input_ids, positions, req_slots, seq_lens, out_cache_loc, key_pos) -> torch.Tensor:
        inputs = _DecodeInputs(positions, out_cache_loc, self.attn.metadata(req_slots, seq_lens, key_pos))
        return self.model.logits(self.model(input_ids, inputs, self.attn))

    def prepare(self, progress: Progress) -> float:
        """Compile every batch bucket by running it once on padding rows. Raises CompileFailed."""
        import torch._dynamo

        # Inductor reads its cache location when it compiles.
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = self.cache_dir
        n = len(self.batch_buckets)
        limits = torch._dynamo.config
        limits.cache_size_limit = max(limits.cache_size_limit, 2 * n)
        limits.accumulated_cache_size_limit = max(limits.accumulated_cache_size_limit, 4 * n)
        step = torch.compile(self._forward, dynamic=False, fullgraph=True)
        start = time.perf_counter()
        try:
            with _quiet_torch_logs():
                for i, b in enumerate(self.batch_buckets):
                    progress(f"compiling the decode step for batch size {b} ({i + 1}/{n})")
                    zeros = torch.zeros(b, dtype=torch.int64, device=self._key_pos[self.max_context].device)
                    with torch.inference_mode():
                        for key_pos in self._key_pos.values():
                            step(zeros, zeros, zeros, zeros + 1, zeros, key_pos)
        except Exception as exc:  # any compiler failure means: stay eager
            first_line = (str(exc).strip().splitlines() or [""])[0]
            raise CompileFailed(f"{type(exc).__name__}: {first_line}") from exc
        self._step = step
        return time.perf_counter() - start

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        assert self._step is not None, "prepare() first"
        n = batch.batch_size
        pad = smallest_bucket(n, self.batch_buckets) - n
        s = smallest_bucket(batch.max_seq_len, self.context_buckets)
        ids, pos, slots, lens, loc = batch.input_ids, batch.positions, batch.req_slots, batch.seq_lens, batch.out_cache_loc
        if pad:
            ids, pos, slots, loc = (F.pad(t, (0, pad)) for t in (ids, pos, slots, loc))
            lens = F.pad(lens, (0, pad), value=1)
        return self._step(ids, pos, slots, lens, loc, self._key_pos[s])[:n]
