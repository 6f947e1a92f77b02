import pytest
import torch

from batonlm.device.future_map import FutureMap, FutureMapError


def t(x):
    return torch.tensor(x, dtype=torch.int64)


def test_resolve_returns_what_was_stashed():
    fm = FutureMap(8, "cpu")
    fm.stash(t([3, 5]), t([42, 43]))
    fm.publish(t([3, 5]), t([10, 20]))
    assert fm.resolve_forward_inputs(t([5, 3]), t([20, 10])).tolist() == [43, 42]


def test_debug_mode_raises_on_a_decode_never_stashed():
    fm = FutureMap(8, "cpu", debug=True)
    fm.stash(t([1]), t([7]))
    fm.publish(t([1]), t([4]))
    with pytest.raises(FutureMapError, match=r"request slot\(s\) \[2\]"):
        fm.resolve_forward_inputs(t([1, 2]), t([4, 9]))


def test_debug_mode_poisons_read_rows():
    fm = FutureMap(8, "cpu", debug=True)
    fm.stash(t([1]), t([7]))
    fm.publish(t([1]), t([4]))
    assert fm.resolve_forward_inputs(t([1]), t([4])).tolist() == [7]
    with pytest.raises(FutureMapError):  # read twice without a new stash
        fm.resolve_forward_inputs(t([1]), t([4]))


def test_debug_mode_catches_a_stale_position():
    fm = FutureMap(8, "cpu", debug=True)
    fm.stash(t([1]), t([7]))
    fm.publish(t([1]), t([4]))
    with pytest.raises(FutureMapError, match="expected positions \\[5\\]"):
        fm.resolve_forward_inputs(t([1]), t([5]))


def test_debug_mode_catches_an_unstashed_decode_in_the_device(stories_path):
    """End to end through the executor: a decode launch for a slot that never ran a prefill."""
    from batonlm.device.inline import InlineDevice
    from batonlm.device.spec import DeviceSpec
    from batonlm.ipc.device_messages import BatchLaunch
    from batonlm.sampling_params import LogitChanges

    spec = DeviceSpec(stories_path, "float32", "cpu", 64, 4, 512, "torch", "torch", debug_future_map=True)
    dev = InlineDevice(spec)
    launch = BatchLaunch(
        batch_id=0, req_slots=[1], prefix_lens=[3], extend_lens=[1], from_future=[True],
        input_ids=[], out_cache_loc=[5], new_slots=[], all_greedy=True, logit_changes=LogitChanges.NONE,
    )
    with pytest.raises(FutureMapError):
        dev.launch(launch)
