"""Plain-torch attention backend: the CPU path and the reference for every other backend.

Rows are attended in groups of one shape (`ForwardBatch.groups`): the decode rows together, the
extend rows together. Each row's context is gathered from the head-major KV pool through its
req-to-token row into [kv_heads, B, S, d]. Queries are laid out as [kv_heads, B, group * E, d],
where `group` query heads share a KV head and E is the group's longest extend: SDPA then treats
(kv head, row) as its batch and a row's query heads and positions as its query length, so
grouped-query attention needs no expansion of K/V and nothing is copied into another layout.
One masked SDPA call per layer and group serves prefills of different lengths, chunks on cached
prefixes, and decodes. On the CPU (float32, heads of 16 or more, no soft-capping or sinks) a group of decode rows
instead reads its keys and values where they are in the pool (`kernels/cpu_attention.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batonlm.kernels import cpu_attention
from batonlm.model_runner.attention.base import AttentionBackend
from batonlm.model_runner.forward_batch import ForwardBatch, RowGroup


@dataclass
class GroupMetadata:
    group: RowGroup
    kv_index: torch.Tensor  # [B * S] KV slots, padded with slot 0
    # Token of the group -> padded query row (b * E + i); None when every row has one token.
    query_index: torch.Tensor | None
    masks: dict[int | None, torch.Tensor]  # sliding window (None = full) -> [1, B, group * E, S] bool
    # Gathered K and V, reused by every layer; None: decode rows read in place (cpu_attention).
    buffers: tuple[torch.Tensor, torch.Tensor] | None


class TorchAttentionBackend(AttentionBackend):
    @property
    def in_place(self) -> bool:
        """Decode rows on the CPU read their keys in the pool (kernels/cpu_attention.py), no gather."""
        return cpu_attention.supports(self.kv_pool, self.softcap) and not self.has_sinks

    def prepare(self, batch: ForwardBatch) -> None:
        batch.attn_metadata = [self._prepare_group(batch, g) for g in batch.groups]

    def _prepare_group(self, batch: ForwardBatch, g: RowGroup) -> GroupMetadata:
        device = batch.req_slots.device
        s, e, b = g.max_seq_len, g.max_extend_len, g.batch_size
        heads_per_kv = self.num_heads // self.num_kv_heads
        seq_lens, prefix_lens = batch.seq_lens[g.rows], batch.prefix_lens[g.rows]
        key_pos = torch.arange(s, device=device)
        valid = key_pos[None, :] < seq_lens[:, None]  # [B, S]
        kv_index = self.req_to_token.table[batch.req_slots[g.rows], :s]
        kv_index = torch.where(valid, kv_index, torch.zeros_like(kv_index))

        query_pos = prefix_lens[:, None] + torch.arange(e, device=device)[None, :]  # [B, E]
        causal = (key_pos[None, None, :] <= query_pos[:, :, None]) & valid[:, None, :]  # [B, E, S]
        masks: dict[int | None, torch.Tensor] = {}
        for window in sorted(set(self.sliding_windows), key=lambda w: -1 if w is None else w):
            m = causal
            if window is not None:
                m = m & (key_pos[None, None, :] > query_pos[:, :, None] - window)
            # Every query head of a group sees the same keys: [1, B, group * E, S].
            masks[window] = m[:, None].expand(-1, heads_per_kv, -1, -1).reshape(1, b, heads_per_kv * e, s)

        query_index = None
        if e > 1:
            n = g.tokens.stop - g.tokens.start
            rows = torch.repeat_interleave(torch.arange(b, device=device), batch.extend_lens[g.rows], output_size=n)
            starts = batch.extend_starts[g.rows] - g.tokens.start
            offset = torch.arange(n, device=device) - starts[rows]
            query_index = rows * e + offset
        in_place = self.in_place and e == 1
        buffers = None if in_place else self.kv_pool.gather_buffers(b * s)
        return GroupMetadata(g, kv_index.reshape(-1), query_index, masks, buffers)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch
    ) -> torch.Tensor:
        self.kv_pool.write(layer, batch.out_cache_loc, k, v)
        groups: list[GroupMetadata] = batch.attn_metadata
        if len(groups) == 1:
            return self._attend(q, layer, groups[0])
        out = q.new_empty((q.shape[0], self.num_heads * self.head_dim))
        for meta in groups:
            out[meta.group.tokens] = self._attend(q[meta.group.tokens], layer, meta)
        return out

    def _attend(self, q: torch.Tensor, layer: int, meta: GroupMetadata) -> torch.Tensor:
        """q: [tokens of the group, H, d] -> [tokens, H * d]."""
        g = meta.group
        b, e, s = g.batch_size, g.max_extend_len, g.max_seq_len
        kvh, d = self.num_kv_heads, self.head_dim
        heads_per_kv = self.num_heads // kvh
        mask = meta.masks[self.sliding_windows[layer]]
        if meta.buffers is None:  # one query a row: [B, H, d] -> [B, kvh, group, d]
            out = cpu_attention.decode_attention(
                q.view(b, kvh, heads_per_kv, d), self.kv_pool.k[layer], self.kv_pool.v[layer],
                meta.kv_index.view(b, s), mask[0, :, 0, :], self.scale)
            return out.reshape(b, self.num_heads * d)
        keys, values = self.kv_pool.gather(layer, meta.kv_index, meta.buffers)
        keys, values = keys.view(kvh, b, s, d), values.view(kvh, b, s, d)
        if meta.query_index is not None:
            padded = q.new_zeros((b * e, self.num_heads, d))
            padded[meta.query_index] = q
            q = padded
        # [B * E, H, d] -> [kvh, B, group * E, d]
        queries = q.reshape(b, e, kvh, heads_per_kv, d).permute(2, 0, 3, 1, 4).reshape(kvh, b, heads_per_kv * e, d)
        sink = None
        if self.sinks is not None:  # a query row's sink is its head's: [kvh, 1, group * E, 1]
            sink = self.sinks.view(kvh, heads_per_kv, 1).expand(kvh, heads_per_kv, e).reshape(kvh, 1, -1, 1)
        out = self.masked_attention(queries, keys, values, mask, sink)
        # out: [kvh, B, group * E, d]
        out = out.view(kvh, b, heads_per_kv, e, d).permute(1, 3, 0, 2, 4).reshape(b * e, self.num_heads * d)
        return out if meta.query_index is None else out[meta.query_index]
