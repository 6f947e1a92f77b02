import pytest

from batonlm.model_runner.kv_allocator import KVSlotAllocator, OutOfSlots, ReqSlotAllocator


def test_kv_slot_zero_is_never_handed_out():
    a = KVSlotAllocator(10)
    slots = a.alloc(10)
    assert sorted(slots) == list(range(1, 11))
    assert 0 not in slots and a.num_free == 0
    with pytest.raises(OutOfSlots, match="asked for 1 KV slot"):
        a.alloc(1)


def test_allocation_is_deterministic_and_reuses_freed_slots():
    a, b = KVSlotAllocator(8), KVSlotAllocator(8)
    for alloc in (a, b):
        x = alloc.alloc(3)
        alloc.free(x[:2])
        alloc.alloc(4)
    assert a._free == b._free
    assert a.num_used == 5


def test_double_free_is_an_error():
    a = ReqSlotAllocator(4)
    s = a.alloc_one()
    a.free([s])
    with pytest.raises(ValueError, match="freed twice"):
        a.free([s])
