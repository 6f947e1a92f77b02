"""Admission by KV memory: a request is admitted with every KV slot it can ever need, so a
running request never runs out of memory and decode steps allocate nothing."""

from __future__ import annotations

from batonlm.scheduler.kv_allocator import KVSlotAllocator, ReqSlotAllocator
from batonlm.scheduler.request import Request


class KVBudget:
    def __init__(self, kv: KVSlotAllocator, req_slots: ReqSlotAllocator) -> None:
        self.kv = kv
        self.req_slots = req_slots

    def can_admit(self, req: Request) -> bool:
        return req.kv_needed <= self.kv.num_free and self.req_slots.num_free > 0

    def admit(self, req: Request) -> None:
        """A request slot, and KV slots for every position the request may fill (contiguous
        when memory allows)."""
        req.req_slot = self.req_slots.alloc_one()
        req.kv_slots = self.kv.alloc(req.kv_needed)

    def release_kv(self, req: Request) -> None:
        """Free a finished request's KV slots, including those it did not get to use."""
        self.kv.free(req.kv_slots)
        req.kv_slots = []

    def release_req_slot(self, req: Request) -> None:
        if req.req_slot is not None:
            self.req_slots.free([req.req_slot])
            req.req_slot = None
