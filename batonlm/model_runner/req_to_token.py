"""ReqToTokenPool: the device table mapping (req_slot, position) -> KV slot."""

from __future__ import annotations

import torch


class ReqToTokenPool:
    """`table[req_slot, pos]` is the KV slot holding the keys/values of that request's token `pos`.

    The scheduler decides the slots; the device side writes them here as each batch starts, so
    that attention can gather a request's whole context from its row.
    """

    def __init__(self, num_req_slots: int, max_context: int, device: torch.device | str) -> None:
        self.table = torch.zeros((num_req_slots, max_context), dtype=torch.int64, device=device)

    def write(self, req_slot_per_token: torch.Tensor, positions: torch.Tensor, kv_slots: torch.Tensor) -> None:
        self.table[req_slot_per_token, positions] = kv_slots

    def write_prefix(self, req_slot: int, kv_slots: torch.Tensor) -> None:
        """Point positions 0..n-1 of a request's row at the KV slots of its cached prefix."""
        self.table[req_slot, : kv_slots.shape[0]] = kv_slots
