"""The device-stream abstraction: launch a batch without waiting, collect its tokens later.

The scheduler sees only this interface; what executes a launch (a worker process, a CUDA
stream, or the scheduler itself) is chosen by `factory.create_device`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from batonlm.device.spec import DeviceSpec
from batonlm.ipc.device_messages import (
    BatchLaunch,
    BatchResult,
    IdleLaunch,
    LoRAMessage,
    SampledLogprobs,
    SampleLaunch,
)


class DeviceError(RuntimeError):
    """The device failed to run a batch, or its worker is gone."""


def host_result(out, batch_id: int) -> BatchResult:
    """A device SampleOutput as plain Python lists (the only place results cross to the host)."""

    def lists(chosen, top_ids, top_lp) -> SampledLogprobs | None:
        return None if chosen is None else SampledLogprobs(chosen.tolist(), top_ids.tolist(), top_lp.tolist())

    return BatchResult(
        batch_id,
        out.token_ids.tolist(),
        lists(out.logprobs, out.top_ids, out.top_logprobs),
        lists(out.prompt_logprobs, out.prompt_top_ids, out.prompt_top_logprobs),
        None if out.accepted is None else out.accepted.tolist(),
        pooled=None if out.pooled is None else out.pooled.tolist(),
    )


class PendingResult(ABC):
    """A launched batch's sampled ids; `wait()` is the only host wait of the steady state."""

    batch_id: int

    @abstractmethod
    def wait(self) -> BatchResult: ...


class DeviceStream(ABC):
    """Executes launches in order. `launch` returns at once; results arrive through handles."""

    spec: DeviceSpec
    # Seconds the device spent computing batches, where the device can tell without a sync.
    compute_s: float = 0.0

    @abstractmethod
    def launch(self, launch: BatchLaunch) -> PendingResult: ...

    @abstractmethod
    def launch_sampling(self, sample: SampleLaunch) -> None:
        """Sample a batch launched with `sample=False`; its pending result then completes."""

    def update_lora(self, msg: LoRAMessage) -> None:
        """Hold, place or drop a LoRA adapter, after the launches before it (no result)."""
        raise NotImplementedError(f"{type(self).__name__} does not serve LoRA adapters")

    def launch_idle(self, idle: IdleLaunch) -> None:
        """DP attention: take part in the other ranks' MLPs this iteration (no result). Only the
        worker-process device runs DP attention."""
        raise NotImplementedError(f"{type(self).__name__} does not run DP attention")

    def check_health(self) -> None:
        """Raise DeviceError when the device is gone (a worker or rank process exited); the
        scheduler calls it while idle, when no result wait would notice. A device in the
        scheduler's own process (CUDA streams, inline) cannot be gone: nothing to check."""
        return None

    @abstractmethod
    def close(self) -> None: ...
