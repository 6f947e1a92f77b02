"""The CUDA device: forward on a forward stream, sampled ids copied to pinned host memory on a
copy stream; a result's `wait()` waits on its `copy_done` event, nothing else."""

from __future__ import annotations

from typing import overload

import torch

from batonlm.device.base import DeviceStream, PendingResult, host_result
from batonlm.device.batch_executor import BatchExecutor
from batonlm.device.factory import build_executor
from batonlm.device.spec import DeviceSpec
from batonlm.ipc.device_messages import BatchLaunch, BatchResult, LoRAMessage, SampleLaunch
from batonlm.model_runner.sampler import SampleOutput


class _CudaPending(PendingResult):
    def __init__(self, batch_id: int) -> None:
        self.batch_id = batch_id
        self.host: SampleOutput | None = None
        self.copy_done: torch.cuda.Event | None = None

    def wait(self) -> BatchResult:
        assert self.copy_done is not None and self.host is not None, "delayed sampling was never launched"
        self.copy_done.synchronize()
        return host_result(self.host, self.batch_id)


class CudaDevice(DeviceStream):
    def __init__(self, spec: DeviceSpec) -> None:
        self.spec = spec
        self.device = torch.device(spec.device)
        torch.cuda.set_device(self.device)
        self.forward_stream = torch.cuda.Stream(self.device)
        self.copy_stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self.forward_stream):
            self.executor: BatchExecutor = build_executor(spec)
        self.forward_stream.synchronize()
        self._delayed: dict[int, _CudaPending] = {}

    def _copy_out(self, out: SampleOutput, pending: _CudaPending) -> None:
        """Copy every result tensor to pinned host memory on the copy stream, after the forward."""
        ready = torch.cuda.Event()
        ready.record(self.forward_stream)

        @overload
        def to_host(t: torch.Tensor) -> torch.Tensor: ...
        @overload
        def to_host(t: None) -> None: ...
        def to_host(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            t.record_stream(self.copy_stream)
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            return host

        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(ready)
            pending.host = SampleOutput(
                to_host(out.token_ids), to_host(out.logprobs), to_host(out.top_ids), to_host(out.top_logprobs),
                to_host(out.prompt_logprobs), to_host(out.prompt_top_ids), to_host(out.prompt_top_logprobs),
                to_host(out.accepted), to_host(out.pooled),
            )
            pending.copy_done = torch.cuda.Event()
            pending.copy_done.record(self.copy_stream)

    def launch(self, launch: BatchLaunch) -> PendingResult:
        pending = _CudaPending(launch.batch_id)
        with torch.cuda.stream(self.forward_stream):
            out = self.executor.run(launch)
        if out is None:
            self._delayed[launch.batch_id] = pending
        else:
            self._copy_out(out, pending)
        return pending

    def launch_sampling(self, sample: SampleLaunch) -> None:
        pending = self._delayed.pop(sample.batch_id)
        with torch.cuda.stream(self.forward_stream):
            out = self.executor.sample_delayed(sample)
        self._copy_out(out, pending)

    def update_lora(self, msg: LoRAMessage) -> None:
        with torch.cuda.stream(self.forward_stream):  # after the launches before it, before those after
            self.executor.runner.update_lora(msg)

    def close(self) -> None:
        self.forward_stream.synchronize()
