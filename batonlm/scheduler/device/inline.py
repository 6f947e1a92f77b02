"""A synchronous device in the scheduler's own process (debugging: nothing overlaps)."""

from __future__ import annotations

from batonlm.ipc.device_messages import BatchLaunch, SampleLaunch
from batonlm.scheduler.batch_executor import BatchExecutor
from batonlm.scheduler.device.base import DeviceSpec, DeviceStream, PendingResult
from batonlm.scheduler.device.runner_factory import build_executor


class _Ready(PendingResult):
    def __init__(self, batch_id: int, ids: list[int] | None) -> None:
        self.batch_id = batch_id
        self.ids = ids

    def wait(self) -> list[int]:
        assert self.ids is not None, "delayed sampling was never launched"
        return self.ids


class InlineDevice(DeviceStream):
    def __init__(self, spec: DeviceSpec) -> None:
        self.spec = spec
        self.executor: BatchExecutor = build_executor(spec)
        self._delayed: dict[int, _Ready] = {}

    def launch(self, launch: BatchLaunch) -> PendingResult:
        ids = self.executor.run(launch)
        pending = _Ready(launch.batch_id, None if ids is None else ids.tolist())
        if ids is None:
            self._delayed[launch.batch_id] = pending
        return pending

    def launch_sampling(self, sample: SampleLaunch) -> None:
        self._delayed.pop(sample.batch_id).ids = self.executor.sample_delayed(sample).tolist()

    def close(self) -> None:
        pass
