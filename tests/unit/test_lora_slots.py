"""The device's LoRA slots: adapters placed on demand, the least recently used idle one out,
never one whose requests run; what the device is told, in order."""

from __future__ import annotations

from batonlm.ipc.device_messages import LoRADrop, LoRALoad, LoRAPlace
from batonlm.scheduler.lora_slots import LoRASlots


def test_adapters_take_turns_least_recently_used_first():
    sent: list = []
    slots = LoRASlots(2, [1, 2, 3], sent.append)
    assert dict(slots.placed) == {1: 1, 2: 2}  # as ModelRunner.use_lora placed them
    assert slots.slot_for(1, set()) == 1 and not sent  # held already: now the most recent
    assert slots.can_place(3, set())
    assert slots.slot_for(3, set()) == 2  # 2 was used least recently
    assert sent == [LoRAPlace(2, 3)] and slots.placements == 1
    # Every slot's adapter is running: 2 waits; once 1 is idle, 2 takes its slot.
    assert not slots.can_place(2, {1, 3})
    assert slots.can_place(2, {3}) and slots.slot_for(2, {3}) == 1
    assert sent[-1] == LoRAPlace(1, 2)
    # A running adapter is never put out, even when it was used least recently.
    assert slots.slot_for(3, {3}) == 2  # 3 used: now 2 is the least recent
    assert slots.slot_for(1, {3}) == 1 and sent[-1] == LoRAPlace(1, 1)


def test_loads_and_unloads_reach_the_device_and_free_the_slot():
    sent: list = []
    slots = LoRASlots(2, [1], sent.append)
    slots.load(2, "b", "/b")
    assert sent == [LoRALoad(2, "b", "/b")] and slots.loaded == {1, 2}
    assert slots.slot_for(2, set()) == 2  # an empty slot first: 1 stays
    slots.unload(1)
    assert sent[-1] == LoRADrop(1) and 1 not in slots.loaded and 1 not in slots.placed
    slots.load(3, "c", "/c")
    assert slots.slot_for(3, {2}) == 1  # the unloaded adapter's slot is empty
