"""FutureMap: the device-side relay of sampled tokens from one iteration to the next.

In the overlap loop batch N is built before batch N-1's tokens reach the host. After batch N-1
samples, its tokens are `stash`ed into a buffer indexed by request slot and `publish` records
the position each will occupy; when batch N starts, `resolve_forward_inputs` gathers its decode
inputs from that buffer. Stream order alone makes this correct: a request has at most one
forward in flight, so its row cannot be overwritten before it is read.
"""

from __future__ import annotations

import torch

POISON = -1


class FutureMapError(RuntimeError):
    """A decode read a relay row that no preceding batch stashed (debug mode only)."""


class FutureMap:
    def __init__(self, num_req_slots: int, device: torch.device | str, debug: bool = False) -> None:
        self.tokens = torch.full((num_req_slots,), POISON, dtype=torch.int64, device=device)
        self.positions = torch.full((num_req_slots,), POISON, dtype=torch.int64, device=device)
        self.debug = debug

    def stash(self, req_slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        self.tokens[req_slots] = token_ids

    def publish(self, req_slots: torch.Tensor, positions: torch.Tensor) -> None:
        """Record that each stashed token will sit at `positions` (its batch's new seq_len)."""
        self.positions[req_slots] = positions

    def resolve_forward_inputs(self, req_slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The input token of each decode row; `positions` are those rows' input positions."""
        ids = self.tokens[req_slots]
        if self.debug:
            # A device sync, acceptable in debug mode only.
            never = ids == POISON
            stale = self.positions[req_slots] != positions
            if bool(never.any() | stale.any()):
                bad = req_slots[never | stale].tolist()
                raise FutureMapError(
                    f"decode input of request slot(s) {bad} was never stashed for this position "
                    f"(expected positions {positions[never | stale].tolist()}, "
                    f"published {self.positions[req_slots][never | stale].tolist()})"
                )
            self.tokens[req_slots] = POISON
            self.positions[req_slots] = POISON
        return ids
