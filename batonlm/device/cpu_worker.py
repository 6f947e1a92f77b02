"""The CPU device: a worker process that plays the accelerator's part.

The worker owns the model weights, the KV cache, the req-to-token table, the FutureMap buffer
and the sampler. The scheduler launches a batch by sending its metadata over a pipe and goes
on with its own work; launches execute in order in the worker, and each pending result's
`wait()` receives that batch's sampled ids. A process, not a thread: with a thread the model's
Python dispatch and the scheduler's Python work serialize on the GIL and nothing overlaps.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time
import traceback
from multiprocessing.connection import Connection

from batonlm import spawn
from batonlm.device.base import (
    BatchResult,
    DeviceError,
    DeviceStream,
    PendingResult,
    host_result,
)
from batonlm.device.spec import DeviceSpec
from batonlm.ipc import codec
from batonlm.ipc.device_messages import (
    BatchLaunch,
    BatchSampled,
    SampleLaunch,
    WorkerFailed,
    WorkerProgress,
    WorkerReady,
    WorkerShutdown,
)

logger = logging.getLogger(__name__)

WORKER_START_TIMEOUT_S = 300.0


class _WorkerPending(PendingResult):
    def __init__(self, device: CpuWorkerDevice, batch_id: int) -> None:
        self.device = device
        self.batch_id = batch_id

    def wait(self) -> BatchResult:
        return self.device._collect(self.batch_id)


class CpuWorkerDevice(DeviceStream):
    def __init__(self, spec: DeviceSpec) -> None:
        self.spec = spec
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(target=worker_main, args=(child, spec), name="batonlm-device", daemon=False)
        spawn.start(self._proc)
        child.close()
        self._results: dict[int, BatchResult] = {}
        self._closed = False
        # Total seconds the worker spent computing batches (forward + sampling).
        self.compute_s = 0.0
        while True:  # progress lines (compiling the decode step), then ready or failed
            if not self._conn.poll(WORKER_START_TIMEOUT_S):
                self.close()
                raise DeviceError(f"CPU device worker was silent for {WORKER_START_TIMEOUT_S:.0f} s while starting")
            msg = self._recv()
            if not isinstance(msg, WorkerProgress):
                break
            logger.info("%s", msg.message)
        if not isinstance(msg, WorkerReady):
            self.close()
            raise DeviceError(f"CPU device worker failed to start: {getattr(msg, 'message', msg)}")

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def _send(self, msg: object) -> None:
        try:
            self._conn.send_bytes(codec.encode(msg))  # type: ignore[arg-type]
        except (BrokenPipeError, OSError) as e:
            raise DeviceError(f"CPU device worker is gone (exit code {self._proc.exitcode})") from e

    def _recv(self) -> object:
        try:
            return codec.decode(self._conn.recv_bytes())
        except (EOFError, OSError) as e:
            self._proc.join(timeout=1.0)
            raise DeviceError(f"CPU device worker is gone (exit code {self._proc.exitcode})") from e

    def launch(self, launch: BatchLaunch) -> PendingResult:
        self._send(launch)
        return _WorkerPending(self, launch.batch_id)

    def launch_sampling(self, sample: SampleLaunch) -> None:
        self._send(sample)

    def _collect(self, batch_id: int) -> BatchResult:
        # Results come back in launch order; keep any that arrive ahead of the one asked for.
        while batch_id not in self._results:
            msg = self._recv()
            if isinstance(msg, WorkerFailed):
                raise DeviceError(f"batch {msg.batch_id} failed on the CPU device: {msg.message}")
            assert isinstance(msg, BatchSampled)
            self._results[msg.batch_id] = BatchResult(
                msg.token_ids, msg.logprobs, msg.prompt_logprobs, msg.accepted
            )
            self.compute_s += msg.compute_s
        return self._results.pop(batch_id)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._conn.send_bytes(codec.encode(WorkerShutdown()))
        except (BrokenPipeError, OSError):
            pass
        self._proc.join(timeout=5.0)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=5.0)
        self._conn.close()


def _keep_freed_memory() -> None:
    """glibc returns large freed blocks to the OS (mmap/trim), so every forward page-faults its
    multi-megabyte temporaries in again; measured on a 32M-parameter model at batch 64 that
    doubled the step time. Keep them in the heap instead (the worker's footprint is bounded by
    its largest forward)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 1 << 30)
    libc.mallopt(m_trim_threshold, 1 << 30)


def worker_main(conn: Connection, spec: DeviceSpec) -> None:
    """Entry point of the device worker process."""
    import signal

    import torch

    # Ctrl-C reaches the whole process group: the scheduler shuts this worker down (or the pipe
    # closes), so a SIGINT must not kill it halfway.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _keep_freed_memory()
    # See factory.cpu_worker_threads: one thread for tiny models, all cores for larger ones.
    torch.set_num_threads(spec.cpu_threads)
    logging.basicConfig(level=os.environ.get("BATONLM_WORKER_LOG_LEVEL", "WARNING"))
    from batonlm.device.factory import build_executor

    try:
        executor = build_executor(spec, lambda m: conn.send_bytes(codec.encode(WorkerProgress(m))))
    except Exception as e:  # report, then exit: the scheduler turns this into a start-up error
        conn.send_bytes(codec.encode(WorkerFailed(-1, f"{type(e).__name__}: {e}")))
        return
    conn.send_bytes(codec.encode(WorkerReady()))
    while True:
        try:
            msg = codec.decode(conn.recv_bytes())
        except (EOFError, OSError):
            return  # the scheduler is gone
        if isinstance(msg, WorkerShutdown):
            return
        batch_id = msg.batch_id  # type: ignore[union-attr]
        t0 = time.perf_counter()
        try:
            if isinstance(msg, BatchLaunch):
                out = executor.run(msg)
            elif isinstance(msg, SampleLaunch):
                out = executor.sample_delayed(msg)
            else:
                raise TypeError(f"unexpected message {type(msg).__name__}")
        except Exception as e:
            # The traceback goes to this process's log; the scheduler gets one line.
            logger.error("batch %s failed on the CPU device:\n%s", batch_id, traceback.format_exc())
            conn.send_bytes(codec.encode(WorkerFailed(batch_id, f"{type(e).__name__}: {e}")))
            return
        if out is not None:
            res = host_result(out)
            conn.send_bytes(codec.encode(
                BatchSampled(batch_id, res.token_ids, time.perf_counter() - t0, res.logprobs, res.prompt_logprobs,
                             res.accepted)
            ))
