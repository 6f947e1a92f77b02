"""Host-side allocators for KV slots and request slots (pure Python: the scheduler owns them)."""

from __future__ import annotations

import bisect


class OutOfSlots(RuntimeError):
    """More slots were asked for than are free."""


class _InUse:
    """Which slots are handed out, to catch double frees."""

    def __init__(self, size: int, name: str) -> None:
        self._flags = bytearray(size)
        self._name = name

    def take(self, start: int, end: int) -> None:
        self._flags[start:end] = b"\x01" * (end - start)

    def give_back(self, slots: list[int]) -> None:
        flags = self._flags
        for s in slots:
            if not flags[s]:
                raise ValueError(f"{self._name} {s} freed twice or never allocated")
            flags[s] = 0


class KVSlotAllocator:
    """Token-granular KV slots `1..size` (slot 0 is the KV pool's padding target).

    Free slots are kept as sorted runs, and a request's slots come first-fit from one run
    when any is long enough: the KV of a request is then contiguous in the pool, which makes
    gathering it for attention a streaming read. When memory is fragmented a request gets
    slots from several runs; any slot can hold any token, so nothing else changes.
    """

    def __init__(self, size: int) -> None:
        self.capacity = size
        self._starts: list[int] = [1]  # run i is [starts[i], ends[i]); runs are disjoint, sorted,
        self._ends: list[int] = [size + 1]  # and never adjacent (freeing coalesces them)
        self._num_free = size
        self._in_use = _InUse(size + 1, "KV slot")

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.capacity - self._num_free

    @property
    def num_runs(self) -> int:
        return len(self._starts)

    def alloc(self, n: int) -> list[int]:
        if n > self._num_free:
            raise OutOfSlots(f"asked for {n} KV slots, {self._num_free} free of {self.capacity}")
        if n == 0:
            return []
        self._num_free -= n
        for i, (s, e) in enumerate(zip(self._starts, self._ends)):
            if e - s >= n:
                self._take(i, n)
                return list(range(s, s + n))
        out: list[int] = []
        while len(out) < n:  # fragmented: whole runs from the lowest up
            s, e = self._starts[0], self._ends[0]
            k = min(e - s, n - len(out))
            self._take(0, k)
            out.extend(range(s, s + k))
        return out

    def _take(self, i: int, k: int) -> None:
        s = self._starts[i]
        self._in_use.take(s, s + k)
        if s + k == self._ends[i]:
            del self._starts[i], self._ends[i]
        else:
            self._starts[i] = s + k

    def free(self, slots: list[int]) -> None:
        if not slots:
            return
        self._in_use.give_back(slots)
        self._num_free += len(slots)
        ordered = sorted(slots)
        start = prev = ordered[0]
        for s in ordered[1:]:
            if s != prev + 1:
                self._insert(start, prev + 1)
                start = s
            prev = s
        self._insert(start, prev + 1)

    def _insert(self, s: int, e: int) -> None:
        i = bisect.bisect_left(self._starts, s)
        if i > 0 and self._ends[i - 1] == s:  # joins the run before
            i -= 1
            self._ends[i] = e
        else:
            self._starts.insert(i, s)
            self._ends.insert(i, e)
        if i + 1 < len(self._starts) and self._starts[i + 1] == e:  # and the run after
            self._ends[i] = self._ends[i + 1]
            del self._starts[i + 1], self._ends[i + 1]


class ReqSlotAllocator:
    """Rows of the req-to-token table (and of the FutureMap): a stack, lowest first."""

    def __init__(self, size: int) -> None:
        self.capacity = size
        self._free: list[int] = list(range(size - 1, -1, -1))
        self._in_use = _InUse(size, "request slot")

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    def alloc_one(self) -> int:
        if not self._free:
            raise OutOfSlots(f"no request slot free of {self.capacity}")
        s = self._free.pop()
        self._in_use.take(s, s + 1)
        return s

    def free(self, slots: list[int]) -> None:
        self._in_use.give_back(slots)
        self._free.extend(reversed(slots))
