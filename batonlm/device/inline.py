"""A synchronous device in the scheduler's own process (debugging: nothing overlaps)."""

from __future__ import annotations

from batonlm.device.base import DeviceStream, PendingResult, host_result
from batonlm.device.batch_executor import BatchExecutor
from batonlm.device.factory import build_executor
from batonlm.device.spec import DeviceSpec
from batonlm.ipc.device_messages import BatchLaunch, BatchResult, LoRAMessage, SampleLaunch


class _Ready(PendingResult):
    def __init__(self, batch_id: int, result: BatchResult | None) -> None:
        self.batch_id = batch_id
        self.result = result

    def wait(self) -> BatchResult:
        assert self.result is not None, "delayed sampling was never launched"
        return self.result


class InlineDevice(DeviceStream):
    def __init__(self, spec: DeviceSpec) -> None:
        self.spec = spec
        self.executor: BatchExecutor = build_executor(spec)
        self._delayed: dict[int, _Ready] = {}

    def launch(self, launch: BatchLaunch) -> PendingResult:
        out = self.executor.run(launch)
        pending = _Ready(launch.batch_id, None if out is None else host_result(out, launch.batch_id))
        if out is None:
            self._delayed[launch.batch_id] = pending
        return pending

    def launch_sampling(self, sample: SampleLaunch) -> None:
        self._delayed.pop(sample.batch_id).result = host_result(self.executor.sample_delayed(sample), sample.batch_id)

    def update_lora(self, msg: LoRAMessage) -> None:
        self.executor.runner.update_lora(msg)

    def close(self) -> None:
        pass
