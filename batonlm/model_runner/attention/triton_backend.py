"""Triton attention backend: reads the token-level KV pool in place (the GPU path).

The new tokens' K/V are written into the pool, then each row group of the batch
(`ForwardBatch.groups`) is attended by a kernel of `batonlm.kernels.attention`: decode rows by
the split-KV decode kernel, extend rows (prefills, chunks on a cached prefix) by the extend
kernel. Nothing is gathered into padded tensors, as the torch backend does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batonlm.kernels.attention import PagedBatch, decode_attention_triton, extend_attention_triton
from batonlm.model_runner.attention.base import AttentionBackend
from batonlm.model_runner.forward_batch import ForwardBatch, RowGroup


@dataclass
class _Group:
    group: RowGroup
    paged: PagedBatch
    decode: bool


class TritonAttentionBackend(AttentionBackend):
    def prepare(self, batch: ForwardBatch) -> None:
        groups = []
        for g in batch.groups:
            starts = batch.extend_starts[g.rows] - g.tokens.start
            paged = PagedBatch(
                self.req_to_token.table, batch.req_slots[g.rows], batch.prefix_lens[g.rows],
                batch.extend_lens[g.rows], starts, g.max_extend_len, g.max_seq_len,
            )
            groups.append(_Group(g, paged, g.max_extend_len == 1))
        batch.attn_metadata = groups

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch
    ) -> torch.Tensor:
        self.kv_pool.write(layer, batch.out_cache_loc, k, v)
        pool = self.kv_pool
        k_pool, v_pool = pool.k[layer], pool.v[layer]
        # An FP8 pool is read as is: the kernels take the layer's scales (1.0 otherwise).
        k_scale, v_scale = pool.k_scale[layer], pool.v_scale[layer]
        window = self.sliding_windows[layer]
        groups: list[_Group] = batch.attn_metadata
        out = q.new_empty(q.shape)
        for g in groups:
            t = g.group.tokens
            if g.decode:
                out[t] = decode_attention_triton(q[t], k_pool, v_pool, g.paged, self.scale, window, None, k_scale, v_scale,
                                                 self.softcap, self.sinks)
            else:
                out[t] = extend_attention_triton(q[t], k_pool, v_pool, g.paged, self.scale, window, k_scale, v_scale,
                                                 self.softcap, self.sinks)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
