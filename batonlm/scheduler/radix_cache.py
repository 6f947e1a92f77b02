"""RadixCache: the KV of token sequences computed before, shared by any request that starts with
them (page size 1: one KV slot per token).

A radix tree over token ids: each edge holds a run of tokens and the KV slot of each. A request
matches the longest cached prefix of its tokens at admission and locks that path while it runs
(locked slots are never evicted); when it finishes (or is retracted) its tokens and slots are
inserted, so the next request with the same prefix reads them instead of computing them. When an
allocation needs room, the least recently used unlocked leaves are evicted and their slots freed.
Recency is a logical clock, so the same workload always evicts the same entries.

Sizes: `evictable_size` counts the slots of unlocked nodes, `protected_size` those of locked ones.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence


class TreeNode:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access")

    def __init__(self, parent: TreeNode | None, key: list[int], value: list[int], last_access: int) -> None:
        self.children: dict[int, TreeNode] = {}  # first token of the child's key -> child
        self.parent = parent
        self.key = key  # the tokens on the edge into this node
        self.value = value  # their KV slots
        self.lock_ref = 0
        self.last_access = last_access

    def __lt__(self, other: TreeNode) -> bool:  # heap order: least recently used first
        return self.last_access < other.last_access


def _common_len(a: Sequence[int], b: Sequence[int], start: int) -> int:
    """Length of the common prefix of a and b[start:]."""
    n = min(len(a), len(b) - start)
    i = 0
    while i < n and a[i] == b[start + i]:
        i += 1
    return i


class RadixCache:
    def __init__(self, free_slots: Callable[[list[int]], None]) -> None:
        self._free_slots = free_slots
        self._clock = 0
        self.root = TreeNode(None, [], [], 0)
        self.root.lock_ref = 1  # never evicted
        self.evictable_size = 0
        self.protected_size = 0

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    @property
    def size(self) -> int:
        return self.evictable_size + self.protected_size

    # ------------------------------------------------------------------ lookup
    def match_prefix(self, tokens: Sequence[int]) -> tuple[list[int], TreeNode]:
        """The KV slots of the longest cached prefix of `tokens`, and the node it ends at (split
        so that the match ends on a node boundary). Marks the path as used now."""
        node, pos, slots = self.root, 0, []
        now = self._tick()
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            n = _common_len(child.key, tokens, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            slots.extend(child.value)
            pos += n
            node = child
        return slots, node

    def match_len(self, tokens: Sequence[int]) -> int:
        """How many leading tokens are cached (changes nothing; for ordering the queue)."""
        node, pos = self.root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            n = _common_len(child.key, tokens, pos)
            pos += n
            if n < len(child.key):
                break
            node = child
        return pos

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Split `child`'s edge after n tokens; returns the new upper node (same locks)."""
        upper = TreeNode(child.parent, child.key[:n], child.value[:n], child.last_access)
        upper.lock_ref = child.lock_ref
        upper.children = {child.key[n]: child}
        assert child.parent is not None
        child.parent.children[child.key[0]] = upper
        child.parent = upper
        child.key, child.value = child.key[n:], child.value[n:]
        return upper

    # ------------------------------------------------------------------ update
    def insert(self, tokens: Sequence[int], slots: Sequence[int]) -> int:
        """Cache `tokens` with their KV `slots`. Returns how many leading tokens were cached
        already: the caller's slots for those are duplicates and are left to it to free."""
        assert len(tokens) == len(slots)
        node, pos = self.root, 0
        now = self._tick()
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                leaf = TreeNode(node, list(tokens[pos:]), list(slots[pos:]), now)
                node.children[tokens[pos]] = leaf
                self.evictable_size += len(leaf.key)
                return pos
            n = _common_len(child.key, tokens, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            pos += n
            node = child
        return pos

    def lock(self, node: TreeNode) -> None:
        """Protect the path root..node from eviction (one count per request using it)."""
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            assert node.parent is not None  # only the root has none
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while node is not self.root:
            node.lock_ref -= 1
            assert node.lock_ref >= 0, "unlocked more often than locked"
            if node.lock_ref == 0:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
            assert node.parent is not None  # only the root has none
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` slots from least recently used unlocked leaves (fewer if
        there are not that many); returns how many were freed."""
        heap = [n for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            leaf = heapq.heappop(heap)
            self._free_slots(leaf.value)
            freed += len(leaf.value)
            self.evictable_size -= len(leaf.key)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[0]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        return freed

    def _nodes(self) -> list[TreeNode]:
        out, todo = [], list(self.root.children.values())
        while todo:
            n = todo.pop()
            out.append(n)
            todo.extend(n.children.values())
        return out

    def reset(self) -> None:
        """Drop every entry and free its slots; only with nothing locked."""
        if self.protected_size:
            raise RuntimeError("the cache is in use")
        self.evict(self.evictable_size)
        assert self.size == 0 and not self.root.children

    def cached_sequences(self) -> list[tuple[list[int], list[int]]]:
        """Every root-to-leaf path as (tokens, slots), for tests."""
        out = []

        def walk(node: TreeNode, tokens: list[int], slots: list[int]) -> None:
            if not node.children and node is not self.root:
                out.append((tokens, slots))
            for child in node.children.values():
                walk(child, tokens + child.key, slots + child.value)

        walk(self.root, [], [])
        return out
