import random

import pytest

from batonlm.scheduler.kv_allocator import KVSlotAllocator, OutOfSlots, ReqSlotAllocator


def test_kv_slot_zero_is_never_handed_out():
    a = KVSlotAllocator(10)
    slots = a.alloc(10)
    assert sorted(slots) == list(range(1, 11))
    assert 0 not in slots and a.num_free == 0
    with pytest.raises(OutOfSlots, match="asked for 1 KV slots, 0 free of 10"):
        a.alloc(1)


def test_requests_get_contiguous_runs_first_fit():
    a = KVSlotAllocator(100)
    x, y, z = a.alloc(30), a.alloc(30), a.alloc(30)
    assert x == list(range(1, 31)) and y == list(range(31, 61)) and z == list(range(61, 91))
    a.free(y)
    assert a.alloc(20) == list(range(31, 51))  # first fit, inside the freed hole


def test_fragmented_memory_still_serves_a_request():
    a = KVSlotAllocator(20)
    parts = [a.alloc(4) for _ in range(5)]
    a.free(parts[1])
    a.free(parts[3])
    got = a.alloc(8)  # no run of 8: two runs of 4
    assert sorted(got) == list(range(5, 9)) + list(range(13, 17))
    assert a.num_free == 0


@pytest.mark.parametrize("most", [50, 1])  # requests' prompts; decode rows' one slot (the runs' head moves)
def test_random_alloc_and_free_keep_every_invariant(most, monkeypatch):
    import batonlm.scheduler.kv_allocator as kv_allocator

    monkeypatch.setattr(kv_allocator, "COMPACT_AT", 4)  # the dead head entries compacted often
    monkeypatch.setattr(kv_allocator, "FIRST_FIT_RUNS", 3)  # and the fragmented path taken often
    rng = random.Random(most)
    a = KVSlotAllocator(500)
    held: list[list[int]] = []
    for _ in range(3000):
        if held and (rng.random() < 0.5 or a.num_free < 50):
            a.free(held.pop(rng.randrange(len(held))))
        else:
            held.append(a.alloc(rng.randint(0, most)))
        owned = [s for h in held for s in h]
        assert len(owned) == len(set(owned)) and all(1 <= s <= 500 for s in owned)
        assert a.num_used == len(owned)
        runs = a.runs()
        assert all(s < e for s, e in runs) and all(e1 < s2 for (_, e1), (s2, _) in zip(runs, runs[1:]))
        assert sum(e - s for s, e in runs) == a.num_free
        assert not set(owned) & {s for r in runs for s in range(*r)}  # a slot is free or held, never both
    for h in held:
        a.free(h)
    assert a.num_runs == 1 and a.num_free == 500


def test_double_free_is_an_error():
    a = KVSlotAllocator(8)
    x = a.alloc(2)
    a.free(x)
    with pytest.raises(ValueError, match="KV slot 1 freed twice"):
        a.free(x)
    r = ReqSlotAllocator(4)
    s = r.alloc_one()
    r.free([s])
    with pytest.raises(ValueError, match="request slot 0 freed twice"):
        r.free([s])


def test_request_slots_are_deterministic():
    a, b = ReqSlotAllocator(8), ReqSlotAllocator(8)
    for r in (a, b):
        x = [r.alloc_one() for _ in range(3)]
        r.free(x[:2])
        [r.alloc_one() for _ in range(4)]
    assert a._free == b._free and a.num_used == 5
