"""Host-side allocators for KV slots and request slots (pure Python: the scheduler owns them)."""

from __future__ import annotations


class OutOfSlots(RuntimeError):
    """More slots were asked for than are free."""


class SlotAllocator:
    """A free list of integer slots in `[first, first + count)`.

    Allocation is deterministic (lowest slots first on a fresh allocator, then LIFO) so that two
    runs with the same schedule use the same slots.
    """

    def __init__(self, count: int, first: int = 0, name: str = "slot") -> None:
        self.name = name
        self.first = first
        self.capacity = count
        # Reversed so that pop() from the end hands out the lowest slot first.
        self._free: list[int] = list(range(first + count - 1, first - 1, -1))
        self._in_use = bytearray(first + count)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfSlots(f"asked for {n} {self.name}s, {len(self._free)} free of {self.capacity}")
        if n == 0:
            return []
        out = self._free[-n:]
        del self._free[-n:]
        out.reverse()
        for s in out:
            self._in_use[s] = 1
        return out

    def alloc_one(self) -> int:
        if not self._free:
            raise OutOfSlots(f"no {self.name} free of {self.capacity}")
        s = self._free.pop()
        self._in_use[s] = 1
        return s

    def free(self, slots: list[int]) -> None:
        for s in slots:
            if not self._in_use[s]:
                raise ValueError(f"{self.name} {s} freed twice or never allocated")
            self._in_use[s] = 0
        self._free.extend(reversed(slots))


class KVSlotAllocator(SlotAllocator):
    """KV slots `1..size`; slot 0 is reserved as the padding target of the KV pool."""

    def __init__(self, size: int) -> None:
        super().__init__(size, first=1, name="KV slot")


class ReqSlotAllocator(SlotAllocator):
    """Rows of the req-to-token table (and of the FutureMap)."""

    def __init__(self, size: int) -> None:
        super().__init__(size, first=0, name="request slot")
