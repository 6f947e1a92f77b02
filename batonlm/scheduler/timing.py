"""Where the scheduler's time goes, per loop (read by the overlap benchmark and the status log)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class LoopTiming:
    schedule_s: float = 0.0  # receiving requests and building batches
    launch_s: float = 0.0  # handing batches to the device
    wait_s: float = 0.0  # blocked on the device for a result
    process_s: float = 0.0  # processing results and sending outputs
    idle_s: float = 0.0  # blocked on the input socket with nothing to do
    batches: int = 0  # forward passes

    @property
    def cpu_s(self) -> float:
        """Scheduler CPU work: everything but waiting on the device."""
        return self.schedule_s + self.launch_s + self.process_s

    def as_dict(self) -> dict[str, float]:
        d = asdict(self)
        d["cpu_s"] = self.cpu_s
        return d
