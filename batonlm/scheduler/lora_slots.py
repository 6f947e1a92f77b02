"""Which LoRA adapter each device slot holds.

The device holds every loaded adapter in host memory (up to `--max-loaded-loras`) and has
`--max-loras-per-batch` slots its forwards read adapters from. A request's adapter is put in a
slot when the request is admitted: the slot holding it already, else an empty one, else the one
whose adapter was used least recently among those no running request uses (least recently used
eviction); when every slot's adapter is running, the request waits. The device applies each
placement in order with the launches, so a forward in flight still reads the slot's old adapter.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

from batonlm.ipc.device_messages import LoRADrop, LoRALoad, LoRAMessage, LoRAPlace


class LoRASlots:
    """The device's adapter slots 1..`slots` (0 is the base model) by load key, least recently
    used first; `send` tells the device (ordered with the launches)."""

    def __init__(self, slots: int, loaded: Iterable[int], send: Callable[[LoRAMessage], None]) -> None:
        self.slots, self.send = slots, send
        self.loaded: set[int] = set(loaded)  # the load keys the device holds
        # Load key -> its slot, least recently used first. At start the first adapters sit in
        # slots 1.. in order (ModelRunner.use_lora places them so).
        self.placed: OrderedDict[int, int] = OrderedDict(
            (key, key) for key in sorted(self.loaded) if key <= slots)
        self.placements = 0  # adapters copied into a slot since start (not counting the first)

    def load(self, key: int, name: str, path: str) -> None:
        """A run-time load: the device reads it into host memory (no slot yet)."""
        self.send(LoRALoad(key, name, path))
        self.loaded.add(key)

    def unload(self, key: int) -> None:
        """An unloaded adapter (none of its requests runs): its slot is empty again."""
        self.loaded.discard(key)
        self.placed.pop(key, None)
        self.send(LoRADrop(key))

    def can_place(self, key: int, busy: set[int]) -> bool:
        """Whether `key` has a slot or can get one without evicting an adapter in `busy`."""
        return key in self.placed or len(self.placed) < self.slots or any(k not in busy for k in self.placed)

    def slot_for(self, key: int, busy: set[int]) -> int:
        """The slot holding `key`, placing it first if needed (`can_place` said it may): an empty
        slot, or the least recently used one whose adapter is not in `busy`."""
        if key in self.placed:
            self.placed.move_to_end(key)
            return self.placed[key]
        taken = set(self.placed.values())
        slot = next((s for s in range(1, self.slots + 1) if s not in taken), None)
        if slot is None:
            victim = next(k for k in self.placed if k not in busy)
            slot = self.placed.pop(victim)
        self.placed[key] = slot
        self.send(LoRAPlace(slot, key))
        self.placements += 1
        return slot
