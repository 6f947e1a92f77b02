"""What rank 0 sends the other tensor-parallel ranks every iteration, over the gloo CPU group.

Rank 0's worker receives each device message (a launch, a delayed sampling, shutdown) from the
scheduler and relays its bytes before executing it, so every rank executes the same launches
in the same order, and the number, order and shapes of the model's collectives depend only on
what was relayed. While the scheduler sends nothing, rank 0 relays a heartbeat every
`HEARTBEAT_S`; a heartbeat ends in an all-reduce every rank must join, so a rank that is gone or
stopped fails the group within `--dist-timeout`, idle or not.
"""

from __future__ import annotations

import torch

from batonlm.distributed.group import TPGroup

HEARTBEAT_S = 1.0
_MESSAGE, _HEARTBEAT = 0, 1


class LaunchRelay:
    def __init__(self, tp: TPGroup) -> None:
        self.tp = tp
        self.messages = 0
        self.heartbeats = 0

    def send(self, data: bytes) -> None:
        """Rank 0: relay one message's bytes."""
        self.tp.broadcast_cpu(torch.tensor([_MESSAGE, len(data)], dtype=torch.int64))
        self.tp.broadcast_cpu(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.messages += 1

    def heartbeat(self) -> None:
        """Rank 0: nothing to relay; check every rank is there."""
        self.tp.broadcast_cpu(torch.tensor([_HEARTBEAT, 0], dtype=torch.int64))
        self.tp.all_reduce_cpu(torch.zeros(1, dtype=torch.int64))
        self.heartbeats += 1

    def recv(self) -> bytes | None:
        """The other ranks: the next message's bytes, or None for a heartbeat."""
        header = self.tp.broadcast_cpu(torch.empty(2, dtype=torch.int64))
        kind, size = int(header[0]), int(header[1])
        if kind == _HEARTBEAT:
            self.tp.all_reduce_cpu(torch.zeros(1, dtype=torch.int64))
            self.heartbeats += 1
            return None
        payload = self.tp.broadcast_cpu(torch.empty(size, dtype=torch.uint8))
        self.messages += 1
        return payload.numpy().tobytes()
