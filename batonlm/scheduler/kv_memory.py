"""KVMemory: the scheduler's account of the KV pool and the request slots.

Every KV slot is, at any time, exactly one of: free; cached in the radix tree (evictable, or
protected while a running request reads it); or held by one request (its own slots, not yet in
the tree). `free + evictable + protected + held == capacity` always (`check_invariant`).
Allocation evicts cached entries when the free list is short. With the radix cache disabled,
nothing is cached and a request's slots are freed when it ends.
"""

from __future__ import annotations

import time
from typing import Any

from batonlm.scheduler.kv_allocator import KVSlotAllocator, ReqSlotAllocator
from batonlm.scheduler.radix_cache import RadixCache
from batonlm.scheduler.request import Request


class KVMemory:
    def __init__(self, kv_capacity: int, num_req_slots: int, radix_cache: bool = True) -> None:
        self.kv = KVSlotAllocator(kv_capacity)
        self.req_slots = ReqSlotAllocator(num_req_slots)
        self.cache = RadixCache(self.kv.free) if radix_cache else None
        self.held = 0  # slots requests hold as their own
        # Prompt tokens admitted, and those the cache served (the hit rate).
        self.admitted_tokens = 0
        self.cached_tokens = 0

    @property
    def capacity(self) -> int:
        return self.kv.capacity

    @property
    def evictable(self) -> int:
        return self.cache.evictable_size if self.cache is not None else 0

    @property
    def protected(self) -> int:
        return self.cache.protected_size if self.cache is not None else 0

    @property
    def available(self) -> int:
        """Slots an allocation can get: the free ones and the evictable cached ones."""
        return self.kv.num_free + self.evictable

    @property
    def in_use(self) -> int:
        """Slots running requests need: their own and the cached prefixes they read."""
        return self.held + self.protected

    def stats_fields(self) -> dict[str, Any]:
        """Its counters, as `SchedulerStats` names them."""
        return {
            "kv_used": self.in_use,
            "kv_capacity": self.capacity,
            "kv_evictable": self.evictable,
            "cached_prompt_tokens": self.cached_tokens,
            "admitted_prompt_tokens": self.admitted_tokens,
            "req_slots_used": self.req_slots.num_used,
            "req_slots_total": self.req_slots.capacity,
        }

    def check_invariant(self) -> None:
        total = self.kv.num_free + self.evictable + self.protected + self.held
        assert total == self.capacity, (
            f"KV slots: {self.kv.num_free} free + {self.evictable} evictable + {self.protected} protected + "
            f"{self.held} held = {total} != capacity {self.capacity}"
        )

    # ------------------------------------------------------------------ requests
    def match(self, req: Request) -> None:
        """Give an admitted request the cached prefix of what it must compute (locked), and a
        request slot. At least one token is always left to compute: its logits give the next
        output."""
        req.req_slot = self.req_slots.alloc_one()
        tokens = req.fill_ids
        req.fill_len = len(tokens)
        if self.cache is None:
            req.kv_slots, req.cached_len, req.cache_node = [], 0, None
        else:
            # Prompt logprobs need the logits of every position from prompt_logprob_from on, mean
            # pooling the hidden states of every position.
            limit = min(len(tokens) - 1, req.prompt_logprob_from) if req.wants_prompt_logprobs else len(tokens) - 1
            if req.pooling == "mean":
                limit = 0
            slots, node = self.cache.match_prefix(req.cache_key(tokens[:limit]))
            self.cache.lock(node)
            req.kv_slots, req.cached_len, req.cache_node = slots, len(slots), node
        req.kv_len = req.cached_len
        if req.first_cached_len is None:
            req.first_cached_len = req.cached_len
            req.queued_s = time.monotonic() - req.arrived
            self.admitted_tokens += len(tokens)
            self.cached_tokens += req.cached_len

    def free_up(self, n: int) -> None:
        """Evict cached entries until `n` slots are free (or nothing is left to evict): one walk
        of the cache for a whole batch's allocations. A walk per decode row cost O(cache nodes)
        per token once the pool was full of cached prefixes."""
        if n > self.kv.num_free and self.cache is not None:
            self.cache.evict(n - self.kv.num_free)

    def alloc(self, req: Request, n: int) -> list[int]:
        """n more slots for `req` (evicting cached entries if need be); raises OutOfSlots."""
        self.free_up(n)
        slots = self.kv.alloc(n)
        req.kv_slots.extend(slots)
        self.held += n
        return slots

    def trim(self, req: Request, n: int) -> None:
        """Keep `req`'s first n positions (its own slots past them are freed): the KV of drafts a
        verification rejected."""
        assert n >= req.cached_len
        dropped = req.kv_slots[n:]
        if dropped:
            self.kv.free(dropped)
            self.held -= len(dropped)
            del req.kv_slots[n:]
        req.kv_len = n

    def release(self, req: Request) -> None:
        """A request stops running (finished, aborted or retracted): the tokens whose KV is
        computed (or being computed by a launched batch) go to the cache, the rest of its slots
        are freed, its prefix is unlocked. Its request slot is released separately (it may still
        be read by a batch in flight)."""
        own = req.kv_slots[req.cached_len :]
        self.held -= len(own)
        if self.cache is None:
            self.kv.free(own)
        else:
            tokens = req.prompt_ids + req.output_ids
            n = min(req.kv_len, len(tokens))  # positions with KV whose token is known
            present = self.cache.insert(req.cache_key(tokens[:n]), req.kv_slots[:n])
            # Its own slots the tree already had (another request computed them too), and
            # those it allocated but never used, are free again.
            self.kv.free(req.kv_slots[req.cached_len : max(present, req.cached_len)] + req.kv_slots[n:])
            assert req.cache_node is not None  # match() locked one: a running request was matched
            self.cache.unlock(req.cache_node)
        req.kv_slots, req.cached_len, req.cache_node = [], 0, None
        req.kv_len = req.fill_len = 0

    def release_req_slot(self, req: Request) -> None:
        if req.req_slot is not None:
            self.req_slots.free([req.req_slot])
            req.req_slot = None

    def flush(self) -> None:
        """Empty the cache (nothing may be running)."""
        if self.cache is not None:
            self.cache.reset()
