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
# One broadcast of this many bytes carries the header (kind, size) and a message that fits
# (a decode launch of 64 rows is under 1 KB); a longer one follows in a second broadcast.
FRAME_BYTES = 4096
_HEADER = 16


class LaunchRelay:
    def __init__(self, tp: TPGroup) -> None:
        self.tp = tp
        self.messages = 0
        self.heartbeats = 0

    def _frame(self, kind: int, data: bytes) -> torch.Tensor:
        frame = torch.zeros(FRAME_BYTES, dtype=torch.uint8)
        frame[:_HEADER].view(torch.int64)[:] = torch.tensor([kind, len(data)])
        if data and len(data) <= FRAME_BYTES - _HEADER:
            frame[_HEADER : _HEADER + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return frame

    def send(self, data: bytes) -> None:
        """Rank 0: relay one message's bytes."""
        self.tp.broadcast_cpu(self._frame(_MESSAGE, data))
        if len(data) > FRAME_BYTES - _HEADER:
            self.tp.broadcast_cpu(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.messages += 1

    def heartbeat(self) -> None:
        """Rank 0: nothing to relay; check every rank is there."""
        self.tp.broadcast_cpu(self._frame(_HEARTBEAT, b""))
        self.tp.all_reduce_cpu(torch.zeros(1, dtype=torch.int64))
        self.heartbeats += 1

    def recv(self) -> bytes | None:
        """The other ranks: the next message's bytes, or None for a heartbeat."""
        frame = self.tp.broadcast_cpu(torch.empty(FRAME_BYTES, dtype=torch.uint8))
        kind, size = (int(v) for v in frame[:_HEADER].view(torch.int64))
        if kind == _HEARTBEAT:
            self.tp.all_reduce_cpu(torch.zeros(1, dtype=torch.int64))
            self.heartbeats += 1
            return None
        self.messages += 1
        if size <= FRAME_BYTES - _HEADER:
            return frame[_HEADER : _HEADER + size].numpy().tobytes()
        return self.tp.broadcast_cpu(torch.empty(size, dtype=torch.uint8)).numpy().tobytes()
