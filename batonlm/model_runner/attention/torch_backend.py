"""Plain-torch attention backend: the CPU path and the reference for every other backend.

Each row's context is gathered from the head-major KV pool through its req-to-token row into
[kv_heads, B, S, d]. Queries are laid out as [kv_heads, B, group * E, d], where `group` query
heads share a KV head and E is the batch's longest extend: SDPA then treats (kv head, row) as
its batch and a row's query heads and positions as its query length, so grouped-query
attention needs no expansion of K/V and nothing is copied into another layout. One masked SDPA
call per layer serves prefills of different lengths, decodes, and any mix of the two.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batonlm.model_runner.attention.base import AttentionBackend
from batonlm.model_runner.forward_batch import ForwardBatch


@dataclass
class TorchAttentionMetadata:
    kv_index: torch.Tensor  # [B * S] KV slots, padded with slot 0
    # Flat token -> padded query row (b * E + i); None when every row has one token.
    query_index: torch.Tensor | None
    masks: dict[int | None, torch.Tensor]  # sliding window (None = full) -> [1, B, group * E, S] bool
    buffers: tuple[torch.Tensor, torch.Tensor]  # gathered K and V, reused by every layer


class TorchAttentionBackend(AttentionBackend):
    def prepare(self, batch: ForwardBatch) -> None:
        device = batch.req_slots.device
        s, e = batch.max_seq_len, batch.max_extend_len
        group = self.num_heads // self.num_kv_heads
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
            # Every query head of a group sees the same keys: [1, B, group * E, S].
            masks[window] = m[:, None].expand(-1, group, -1, -1).reshape(1, batch.batch_size, group * e, s)

        query_index = None
        if e > 1:
            rows = torch.repeat_interleave(
                torch.arange(batch.batch_size, device=device), batch.extend_lens, output_size=batch.num_tokens
            )
            offset = torch.arange(batch.num_tokens, device=device) - batch.extend_starts[rows]
            query_index = rows * e + offset
        batch.attn_metadata = TorchAttentionMetadata(
            kv_index.reshape(-1), query_index, masks, self.kv_pool.gather_buffers(batch.batch_size * s)
        )

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch
    ) -> torch.Tensor:
        meta: TorchAttentionMetadata = batch.attn_metadata
        self.kv_pool.write(layer, batch.out_cache_loc, k, v)
        b, e, s = batch.batch_size, batch.max_extend_len, batch.max_seq_len
        kvh, d = self.num_kv_heads, self.head_dim
        group = self.num_heads // kvh
        keys, values = self.kv_pool.gather(layer, meta.kv_index, meta.buffers)
        keys, values = keys.view(kvh, b, s, d), values.view(kvh, b, s, d)
        if meta.query_index is not None:
            padded = q.new_zeros((b * e, self.num_heads, d))
            padded[meta.query_index] = q
            q = padded
        # [B * E, H, d] -> [kvh, B, group * E, d]
        queries = q.view(b, e, kvh, group, d).permute(2, 0, 3, 1, 4).reshape(kvh, b, group * e, d)
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=meta.masks[self.sliding_windows[layer]], scale=self.scale
        )  # [kvh, B, group * E, d]
        out = out.view(kvh, b, group, e, d).permute(1, 3, 0, 2, 4).reshape(b * e, self.num_heads * d)
        return out if meta.query_index is None else out[meta.query_index]
