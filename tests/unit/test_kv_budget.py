"""Admission by KV memory: a request holds every KV slot it can need, and gives all back."""

import pytest

from batonlm.sampling_params import SamplingParams
from batonlm.scheduler.kv_allocator import KVSlotAllocator, OutOfSlots, ReqSlotAllocator
from batonlm.scheduler.kv_budget import KVBudget
from batonlm.scheduler.request import Request


def request(prompt_len, max_new, ctx=100):
    return Request("r", list(range(1, prompt_len + 1)), SamplingParams(max_new_tokens=max_new), 0, ctx, (2,))


def test_a_request_needs_its_prompt_and_outputs_but_the_last():
    assert request(10, 5).kv_needed == 14  # the last output is never fed back
    r = request(90, 50, ctx=100)  # capped by the context: 10 new tokens at most
    assert (r.kv_needed, r.max_new_tokens) == (99, 10)


def test_admit_takes_a_request_slot_and_contiguous_kv_slots_then_gives_them_back():
    budget = KVBudget(KVSlotAllocator(40), ReqSlotAllocator(2))
    a, b, c = request(10, 11), request(5, 6), request(3, 3)
    assert budget.can_admit(a)
    budget.admit(a)
    assert a.req_slot == 0 and a.kv_slots == list(range(1, 21))  # slot 0 is the padding target
    budget.admit(b)
    assert b.req_slot == 1 and b.kv_slots == list(range(21, 31))
    assert budget.kv.num_free == 10 and not budget.can_admit(c)  # KV fits, but no request slot
    budget.release_kv(a)
    budget.release_req_slot(a)
    assert a.kv_slots == [] and a.req_slot is None and budget.can_admit(c)
    budget.release_kv(b)
    budget.release_req_slot(b)
    assert budget.kv.num_free == 40 and budget.req_slots.num_free == 2 and budget.kv.num_runs == 1


def test_too_little_kv_memory_is_not_admitted():
    budget = KVBudget(KVSlotAllocator(12), ReqSlotAllocator(4))
    big = request(10, 4)  # needs 13
    assert not budget.can_admit(big)
    with pytest.raises(OutOfSlots):
        budget.admit(big)
