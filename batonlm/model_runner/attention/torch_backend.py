"""Plain-torch attention backend: the CPU path and the reference for every other backend.

Each row's context is gathered from the KV pool through its req-to-token row into a padded
[B, S, kv_heads, d] block; queries are padded to [B, E, heads, d]; one masked SDPA call per
layer serves prefills of different lengths, decodes, and any mix of the two.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batonlm.model_runner.attention.base import AttentionBackend, register_attention_backend
from batonlm.model_runner.forward_batch import ForwardBatch


@dataclass
class TorchAttentionMetadata:
    kv_index: torch.Tensor  # [B * S] KV slots, padded with slot 0 (index_select is much faster
    # on the CPU than advanced indexing with a 2-D index)
    # Flat token -> padded query row (b * E + i); None when every row has one token.
    query_index: torch.Tensor | None
    masks: dict[int | None, torch.Tensor]  # sliding window (None = full) -> [B, 1, E, S] bool


@register_attention_backend
class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def prepare(self, batch: ForwardBatch) -> None:
        device = batch.req_slots.device
        s, e = batch.max_seq_len, batch.max_extend_len
        key_pos = torch.arange(s, device=device)
        valid = key_pos[None, :] < batch.seq_lens[:, None]  # [B, S]
        kv_index = self.req_to_token.table[batch.req_slots, :s]
        kv_index = torch.where(valid, kv_index, torch.zeros_like(kv_index))

        query_pos = batch.prefix_lens[:, None] + torch.arange(e, device=device)[None, :]  # [B, E]
        causal = (key_pos[None, None, :] <= query_pos[:, :, None]) & valid[:, None, :]  # [B, E, S]
        masks: dict[int | None, torch.Tensor] = {}
        for window in sorted(set(self.sliding_windows), key=lambda w: -1 if w is None else w):
            m = causal
            if window is not None:
                m = m & (key_pos[None, None, :] > query_pos[:, :, None] - window)
            masks[window] = m[:, None, :, :]

        query_index = None
        if e > 1:
            rows = torch.repeat_interleave(
                torch.arange(batch.batch_size, device=device), batch.extend_lens, output_size=batch.num_tokens
            )
            offset = torch.arange(batch.num_tokens, device=device) - batch.extend_starts[rows]
            query_index = rows * e + offset
        batch.attn_metadata = TorchAttentionMetadata(kv_index.reshape(-1), query_index, masks)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch
    ) -> torch.Tensor:
        meta: TorchAttentionMetadata = batch.attn_metadata
        self.kv_pool.write(layer, batch.out_cache_loc, k, v)
        b, e, s = batch.batch_size, batch.max_extend_len, batch.max_seq_len
        shape = (b, s, self.num_kv_heads, self.head_dim)
        keys = self.kv_pool.k[layer].index_select(0, meta.kv_index).view(shape).transpose(1, 2)  # [B, kvh, S, d]
        values = self.kv_pool.v[layer].index_select(0, meta.kv_index).view(shape).transpose(1, 2)
        if meta.query_index is None:
            queries = q[:, None]  # [B, 1, h, d]
        else:
            queries = q.new_zeros((b * e, self.num_heads, self.head_dim))
            queries[meta.query_index] = q
            queries = queries.view(b, e, self.num_heads, self.head_dim)
        out = F.scaled_dot_product_attention(
            queries.transpose(1, 2),
            keys,
            values,
            attn_mask=meta.masks[self.sliding_windows[layer]],
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )  # [B, h, E, d]
        out = out.transpose(1, 2).reshape(b * e, self.num_heads * self.head_dim)
        return out if meta.query_index is None else out[meta.query_index]
