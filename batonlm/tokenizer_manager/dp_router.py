"""Which data-parallel replica a request goes to (`--dp N`).

Each replica is a scheduler with its own device and prefix cache. `shortest_queue` sends a
request to the replica with the fewest requests in flight (sent and not finished: running or
waiting there); `round_robin` takes turns; `prefix` (the default) sends it where its longest
prompt prefix went before — that replica's radix cache likely holds it — unless that replica has
`PREFIX_SLACK` more requests in flight than the least loaded one, which then takes it.

Prefixes are remembered as a chain of hashes of `BLOCK` token blocks (a prompt's first
`MAX_BLOCKS` blocks), in an LRU table of at most `MAX_ENTRIES` blocks.
"""

from __future__ import annotations

from collections import OrderedDict

BLOCK = 16
MAX_BLOCKS = 256
MAX_ENTRIES = 200_000
PREFIX_SLACK = 4
METHODS = ("prefix", "shortest_queue", "round_robin")


def block_hashes(input_ids: list[int]) -> list[int]:
    """One hash per whole block of the prompt, each covering every token before it too."""
    out, h = [], 0
    for start in range(0, min(len(input_ids) // BLOCK, MAX_BLOCKS) * BLOCK, BLOCK):
        h = hash((h, tuple(input_ids[start : start + BLOCK])))
        out.append(h)
    return out


class DPRouter:
    def __init__(self, replicas: int, method: str = "prefix") -> None:
        if method not in METHODS:
            raise ValueError(f"load balance method {method!r} is not one of {', '.join(METHODS)}")
        self.replicas = replicas
        self.method = method
        self.in_flight = [0] * replicas
        self.routed = [0] * replicas
        self.prefix_hits = 0
        self._next = 0
        self._blocks: OrderedDict[int, int] = OrderedDict()

    def choose(self, input_ids: list[int]) -> int:
        """The replica for a new request; counts it in flight there until `release`."""
        least = min(range(self.replicas), key=lambda i: (self.in_flight[i], i))
        if self.method == "round_robin":
            chosen, self._next = self._next, (self._next + 1) % self.replicas
        elif self.method == "shortest_queue":
            chosen = least
        else:
            hashes = block_hashes(input_ids)
            chosen = least
            for h in reversed(hashes):  # the longest prefix seen before
                owner = self._blocks.get(h)
                if owner is not None:
                    if self.in_flight[owner] - self.in_flight[least] < PREFIX_SLACK:
                        chosen = owner
                        self.prefix_hits += 1
                    break
            for h in hashes:
                self._blocks[h] = chosen
                self._blocks.move_to_end(h)
            while len(self._blocks) > MAX_ENTRIES:
                self._blocks.popitem(last=False)
        self.in_flight[chosen] += 1
        self.routed[chosen] += 1
        return chosen

    def release(self, replica: int) -> None:
        self.in_flight[replica] -= 1
