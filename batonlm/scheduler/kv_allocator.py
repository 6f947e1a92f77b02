"""Host-side allocators for KV slots and request slots (pure Python: the scheduler owns them)."""

from __future__ import annotations

import bisect

# Runs a first-fit search looks at. A pool full of cached prefixes evicted leaf by leaf splits
# into thousands of short runs; scanning them all cost the scheduler a third of its time
# (benchmarks/host_overhead.py, n=4 at 1024 streams).
FIRST_FIT_RUNS = 32
# Dead entries before the lowest live run that make the run lists be compacted (half of them at least).
COMPACT_AT = 1024


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
    when one of the lowest `FIRST_FIT_RUNS` is long enough: the KV of a request is then
    contiguous in the pool, which makes gathering it for attention a streaming read. When
    memory is fragmented a request gets slots from several runs, the lowest first (which
    also mends the fragmentation); any slot can hold any token, so nothing else changes.
    """

    def __init__(self, size: int) -> None:
        self.capacity = size
        # Runs head.. are live: run i is [starts[i], ends[i]); runs are disjoint, sorted and never
        # adjacent (freeing coalesces them). Entries before head are dead: taking or adding the
        # lowest run moves head (O(1)) instead of shifting the whole list, which a decode row's
        # one slot from a pool split into thousands of runs did every token.
        self._starts: list[int] = [1]
        self._ends: list[int] = [size + 1]
        self._head = 0
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
        return len(self._starts) - self._head

    def runs(self) -> list[tuple[int, int]]:
        """The free runs [start, end), lowest first."""
        h = self._head
        return list(zip(self._starts[h:], self._ends[h:]))

    def alloc(self, n: int) -> list[int]:
        if n > self._num_free:
            raise OutOfSlots(f"asked for {n} KV slots, {self._num_free} free of {self.capacity}")
        if n == 0:
            return []
        self._num_free -= n
        starts, ends, h = self._starts, self._ends, self._head
        for i in range(h, min(h + FIRST_FIT_RUNS, len(starts))):
            s = starts[i]
            if ends[i] - s >= n:
                self._take(i, n)
                return list(range(s, s + n))
        out: list[int] = []
        while len(out) < n:  # fragmented: whole runs from the lowest up
            i = self._head
            s, e = starts[i], ends[i]
            k = min(e - s, n - len(out))
            self._take(i, k)
            out.extend(range(s, s + k))
        return out

    def _take(self, i: int, k: int) -> None:
        s = self._starts[i]
        self._in_use.take(s, s + k)
        if s + k < self._ends[i]:
            self._starts[i] = s + k
        elif i == self._head:
            self._head += 1
            if self._head >= COMPACT_AT and 2 * self._head >= len(self._starts):  # compact now and then
                del self._starts[: self._head], self._ends[: self._head]
                self._head = 0
        else:
            del self._starts[i], self._ends[i]

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
        starts, ends, h = self._starts, self._ends, self._head
        i = bisect.bisect_left(starts, s, lo=h)
        if i > h and ends[i - 1] == s:  # joins the run before
            i -= 1
            ends[i] = e
        elif i == h and h > 0:  # a new lowest run: into the dead entry before head
            i = self._head = h - 1
            starts[i], ends[i] = s, e
        else:
            starts.insert(i, s)
            ends.insert(i, e)
        if i + 1 < len(starts) and starts[i + 1] == e:  # and the run after
            ends[i] = ends[i + 1]
            del starts[i + 1], ends[i + 1]


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
