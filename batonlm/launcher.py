"""Start the scheduler process and connect to it over ZMQ in a private temporary directory."""

from __future__ import annotations

import logging
import multiprocessing as mp
import shutil
import threading
import time
from dataclasses import dataclass

from batonlm import spawn
from batonlm.config import ServerArgs
from batonlm.ipc import codec
from batonlm.ipc.messages import SchedulerFailed, SchedulerInfo

logger = logging.getLogger(__name__)

SCHEDULER_START_TIMEOUT_S = 600.0


class SchedulerStartError(RuntimeError):
    """The scheduler process could not load the model or start its device."""


class StartCancelled(SchedulerStartError):
    """The start was cancelled (the server was told to stop while it started)."""


@dataclass
class SchedulerHandle:
    process: mp.process.BaseProcess
    request_endpoint: str
    output_endpoint: str
    info: SchedulerInfo
    ipc_dir: str

    def stop(self, timeout_s: float = 10.0) -> None:
        """Wait for the process to exit (after a ShutdownRequest), kill it if it won't."""
        self.process.join(timeout_s)
        if self.process.is_alive():
            logger.warning("scheduler did not exit within %.0f s; terminating it", timeout_s)
            self.process.terminate()
            self.process.join(5.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5.0)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def start_scheduler(
    args: ServerArgs, ipc_dir: str, request_endpoint: str, output_endpoint: str, dp_rank: int = 0,
    cancel: threading.Event | None = None,
) -> SchedulerHandle:
    """Spawn the scheduler (of data-parallel replica `dp_rank`) and wait until it reports ready.
    The caller must already have bound both endpoints (PUSH on requests, PULL on outputs). Setting
    `cancel` kills the scheduler (its device workers die with it) and raises StartCancelled."""
    from batonlm.scheduler.process import run_scheduler_process

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(
        target=run_scheduler_process,
        args=(args, request_endpoint, output_endpoint, child, dp_rank, ipc_dir),
        name="batonlm-scheduler" if args.dp_size == 1 else f"batonlm-scheduler-dp{dp_rank}",
        daemon=False,
    )
    spawn.start(proc)
    child.close()
    deadline = time.monotonic() + SCHEDULER_START_TIMEOUT_S
    while not parent.poll(0.1):
        if cancel is not None and cancel.is_set():
            proc.kill()
            proc.join(5.0)
            raise StartCancelled("the start was cancelled")
        if not proc.is_alive():
            raise SchedulerStartError(f"the scheduler process exited during start-up (exit code {proc.exitcode})")
        if time.monotonic() > deadline:
            proc.kill()
            proc.join(5.0)
            raise SchedulerStartError(f"the scheduler did not start within {SCHEDULER_START_TIMEOUT_S:.0f} s")
    try:
        msg = codec.decode(parent.recv_bytes())
    except EOFError:
        proc.join(5.0)
        raise SchedulerStartError(f"the scheduler process exited during start-up (exit code {proc.exitcode})") from None
    if isinstance(msg, SchedulerFailed):
        proc.join(5.0)
        raise SchedulerStartError(msg.message)
    assert isinstance(msg, SchedulerInfo)
    return SchedulerHandle(proc, request_endpoint, output_endpoint, msg, ipc_dir)
