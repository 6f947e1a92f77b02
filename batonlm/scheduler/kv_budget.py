"""Admission by KV memory: a request is admitted only when every KV slot it can ever need is
free and not promised to a running request, so a running request never runs out of memory."""

from __future__ import annotations

from batonlm.model_runner.kv_allocator import KVSlotAllocator, ReqSlotAllocator
from batonlm.scheduler.request import Request


class KVBudget:
    def __init__(self, kv: KVSlotAllocator, req_slots: ReqSlotAllocator) -> None:
        self.kv = kv
        self.req_slots = req_slots
        self.reserved = 0  # slots promised to running requests beyond what they hold

    @property
    def available(self) -> int:
        return self.kv.num_free - self.reserved

    def never_fits(self, req: Request) -> bool:
        return req.kv_needed > self.kv.capacity

    def can_admit(self, req: Request) -> bool:
        return req.kv_needed <= self.available and self.req_slots.num_free > 0

    def admit(self, req: Request) -> None:
        """Give `req` a request slot and the KV slots of its prompt; reserve the rest."""
        req.req_slot = self.req_slots.alloc_one()
        req.kv_slots = self.kv.alloc(req.prompt_len)
        req.kv_reserved = req.kv_needed - req.prompt_len
        self.reserved += req.kv_reserved

    def grow(self, req: Request) -> None:
        """One more KV slot for a decode step, out of the request's reservation."""
        req.kv_slots.append(self.kv.alloc_one())
        req.kv_reserved -= 1
        self.reserved -= 1

    def release_kv(self, req: Request) -> None:
        """Free a finished request's KV slots and the rest of its reservation."""
        self.kv.free(req.kv_slots)
        req.kv_slots = []
        self.reserved -= req.kv_reserved
        req.kv_reserved = 0

    def release_req_slot(self, req: Request) -> None:
        if req.req_slot is not None:
            self.req_slots.free([req.req_slot])
            req.req_slot = None
