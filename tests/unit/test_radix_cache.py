"""The radix cache against a naive reference, and the KV pool's invariant, under random workloads
(hypothesis)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batonlm.sampling_params import SamplingParams
from batonlm.scheduler.kv_memory import KVMemory
from batonlm.scheduler.radix_cache import RadixCache
from batonlm.scheduler.request import Request

TOKENS = st.lists(st.integers(0, 3), min_size=1, max_size=12)  # a tiny alphabet: many shared prefixes


class NaiveCache:
    """Every cached prefix (as a tuple) -> the KV slot of its last token."""

    def __init__(self) -> None:
        self.slot: dict[tuple[int, ...], int] = {}

    def insert(self, tokens, slots) -> int:
        present = self.match_len(tokens)
        for i in range(present, len(tokens)):
            self.slot[tuple(tokens[: i + 1])] = slots[i]
        return present

    def match_len(self, tokens) -> int:
        n = 0
        while n < len(tokens) and tuple(tokens[: n + 1]) in self.slot:
            n += 1
        return n

    def match(self, tokens) -> list[int]:
        return [self.slot[tuple(tokens[: i + 1])] for i in range(self.match_len(tokens))]


def _check_tree(cache: RadixCache, locked_nodes: list) -> None:
    """Each node's lock count is the number of locks on nodes of its subtree; the protected and
    evictable sizes are the key lengths of locked and unlocked nodes."""
    protected = evictable = 0
    for node in cache._nodes():
        below, todo = 0, [node]
        while todo:
            n = todo.pop()
            below += sum(1 for m in locked_nodes if m is n)
            todo.extend(n.children.values())
        assert node.lock_ref == below
        assert len(node.key) == len(node.value) > 0
        if node.lock_ref:
            protected += len(node.key)
        else:
            evictable += len(node.key)
    assert (cache.protected_size, cache.evictable_size) == (protected, evictable)


def _paths(cache: RadixCache) -> set[tuple[int, ...]]:
    return {tuple(tokens[: i + 1]) for tokens, _ in cache.cached_sequences() for i in range(len(tokens))}


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(["insert", "match", "lock", "unlock", "evict"]), TOKENS,
                          st.integers(1, 10)), max_size=40))
def test_the_tree_agrees_with_the_naive_reference(ops):
    freed: list[int] = []
    cache = RadixCache(freed.extend)
    naive = NaiveCache()
    next_slot = 1
    locks: list[tuple[object, tuple[int, ...]]] = []
    for op, tokens, k in ops:
        if op == "insert":
            slots = list(range(next_slot, next_slot + len(tokens)))
            next_slot += len(tokens)
            present = cache.insert(tokens, slots)
            assert present == naive.insert(tokens, slots)
            freed.extend(slots[:present])  # the caller frees its duplicates
        elif op == "match":
            slots, node = cache.match_prefix(tokens)
            assert slots == naive.match(tokens)
            assert cache.match_len(tokens) == len(slots)
        elif op == "lock":
            slots, node = cache.match_prefix(tokens)
            cache.lock(node)
            locks.append((node, tuple(tokens[: len(slots)])))
        elif op == "unlock" and locks:
            node, _ = locks.pop(k % len(locks))
            cache.unlock(node)
        elif op == "evict":
            before = _paths(cache)
            got = cache.evict(k)
            after = _paths(cache)
            gone = before - after
            assert got == len(gone) and (got >= k or cache.evictable_size == 0)
            for path in gone:  # evicted entries were unlocked, and their slots freed
                assert not any(path[: len(p)] == p and len(p) >= len(path) for _, p in locks)
                del naive.slot[path]
        # Locked prefixes stay matchable; the sizes add up to what the tree holds.
        _check_tree(cache, [n for n, _ in locks])
        for _, prefix in locks:
            assert cache.match_len(list(prefix)) >= len(prefix)
        assert cache.size == len(_paths(cache)) == len(naive.slot)
        assert set(naive.slot) == _paths(cache)
        held = sum(len(s) for _, s in cache.cached_sequences())
        assert cache.size <= held


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(TOKENS, st.lists(st.integers(0, 3), max_size=4), st.booleans()), min_size=1, max_size=25),
       st.integers(12, 60), st.booleans())
def test_free_plus_evictable_plus_in_use_is_the_capacity(workload, capacity, radix):
    """Requests admitted, grown, finished or retracted in random order: the pool's invariant
    holds after every step, and after a flush with nothing running everything is free."""
    mem = KVMemory(capacity, 8, radix_cache=radix)
    active: list[Request] = []
    for i, (prompt, outputs, retract) in enumerate(workload):
        req = Request(f"r{i}", prompt, SamplingParams(max_new_tokens=8), 0, 64, (99,))
        if mem.req_slots.num_free == 0:
            old = active.pop(0)
            mem.release(old)
            mem.release_req_slot(old)
        mem.match(req)
        need = req.fill_len - req.kv_len + len(outputs)
        while need > mem.available and active:  # retract to make room, as the planner does
            old = active.pop(0)
            mem.release(old)
            mem.release_req_slot(old)
        if need > mem.available:
            mem.release(req)
            mem.release_req_slot(req)
            mem.check_invariant()
            continue
        mem.alloc(req, req.fill_len - req.kv_len)
        req.kv_len = req.fill_len
        for tok in outputs:
            req.output_ids.append(tok)
            mem.alloc(req, 1)
            req.kv_len += 1
            mem.check_invariant()
        if retract:
            mem.release(req)
            mem.release_req_slot(req)
        else:
            active.append(req)
        mem.check_invariant()
    for req in active:
        mem.release(req)
        mem.release_req_slot(req)
        mem.check_invariant()
    assert mem.in_use == 0 and mem.protected == 0
    mem.flush()
    assert mem.kv.num_free == capacity and mem.kv.num_runs == 1 and mem.req_slots.num_free == 8
