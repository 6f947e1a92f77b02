"""ForwardBatch: the device-side inputs of one forward pass over a flattened batch of tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from batonlm.model_runner.host_to_device import to_device


@dataclass(frozen=True)
class RowGroup:
    """Consecutive rows that attention pads to one shape: decode-like rows (one new token each)
    or extend rows (several). A mixed batch has one of each; padding a decode row to a long
    chunk's length would multiply its attention work by the chunk's length."""

    rows: slice
    tokens: slice
    max_extend_len: int
    max_seq_len: int

    @property
    def batch_size(self) -> int:
        return self.rows.stop - self.rows.start


def row_groups(extend_lens: list[int], seq_lens: list[int]) -> list[RowGroup]:
    groups, start, tok = [], 0, 0
    for i in range(1, len(extend_lens) + 1):
        if i == len(extend_lens) or (extend_lens[i] == 1) != (extend_lens[start] == 1):
            n = sum(extend_lens[start:i])
            groups.append(RowGroup(slice(start, i), slice(tok, tok + n), max(extend_lens[start:i]),
                                   max(seq_lens[start:i])))
            start, tok = i, tok + n
    return groups


@dataclass
class ForwardBatch:
    """Rows are requests; each row `b` computes `extend_lens[b]` tokens at positions
    `prefix_lens[b] .. seq_lens[b] - 1`, stored flat in request order ([T] tensors)."""

    input_ids: torch.Tensor | None  # [T]; may be set after build (it can depend on positions)
    positions: torch.Tensor  # [T]
    out_cache_loc: torch.Tensor  # [T] KV slot each new token is written to
    req_slots: torch.Tensor  # [B]
    prefix_lens: torch.Tensor  # [B]
    extend_lens: torch.Tensor  # [B]
    seq_lens: torch.Tensor  # [B]
    extend_starts: torch.Tensor  # [B] offset of each row's first token in the flat arrays
    last_token_index: torch.Tensor  # [B] flat index of each row's last token
    # Host-side facts the attention backend needs to size its work without a device sync.
    max_extend_len: int
    max_seq_len: int
    num_tokens: int
    groups: list[RowGroup]
    attn_metadata: Any = None
    # DP attention: every data-parallel rank's token count this iteration (None: not DP attention).
    dp_tokens: list[int] | None = None
    lora: Any = None  # the forward's LoRA adapters (model_runner/lora.py LoRABatch; None: none)
    # LongRoPE: the rows the rotary reads at `positions` + an offset into its long-factor table
    # (None: every row at `positions`). Only the rotary reads them: masks and inputs go by
    # `positions`.
    rope_positions: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return int(self.req_slots.shape[0])

    @classmethod
    def build(
        cls,
        out_cache_loc: torch.Tensor,
        req_slots: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
        device: torch.device | str,
        input_ids: torch.Tensor | None = None,
        rope_offsets: list[int] | None = None,
    ) -> ForwardBatch:
        """Derive positions and offsets from per-row host lists, copied to the device in one
        tensor (one H2D copy, one allocation) whose slices are the fields."""
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        n = len(extend_lens)
        if all(e == 1 for e in extend_lens):  # a decode batch: the token of row b is at b, one group
            acc, starts = n, list(range(n))
            positions = list(prefix_lens)
            last = starts
            groups = [RowGroup(slice(0, n), slice(0, n), 1, max(seq_lens))] if n else []
        else:
            acc, starts = 0, []
            for e in extend_lens:
                starts.append(acc)
                acc += e
            positions = []
            for p, e in zip(prefix_lens, extend_lens):
                positions.extend(range(p, p + e))
            last = [s + e - 1 for s, e in zip(starts, extend_lens)]
            groups = row_groups(extend_lens, seq_lens)
        rope: list[int] = []
        if rope_offsets:  # each token's position plus its row's table offset
            per_token = [o for o, e in zip(rope_offsets, extend_lens) for _ in range(e)]
            rope = [pos + off for pos, off in zip(positions, per_token)]
        fields = (positions, req_slots, prefix_lens, extend_lens, seq_lens, starts, last, rope)
        packed = to_device([x for f in fields for x in f], torch.int64, torch.device(device))
        views = packed.split([len(f) for f in fields])  # the fields' views in one call
        positions_t, req_slots_t, prefix_t, extend_t, seq_t, starts_t, last_t, rope_t = views
        return cls(
            input_ids=input_ids,
            positions=positions_t,
            out_cache_loc=out_cache_loc,
            req_slots=req_slots_t,
            prefix_lens=prefix_t,
            extend_lens=extend_t,
            seq_lens=seq_t,
            extend_starts=starts_t,
            last_token_index=last_t,
            max_extend_len=max(extend_lens) if extend_lens else 0,
            max_seq_len=max(seq_lens) if seq_lens else 0,
            num_tokens=acc,
            groups=groups,
            rope_positions=rope_t if rope else None,
        )
