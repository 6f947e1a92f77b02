"""The CPU device: a worker process that plays the accelerator's part.

The worker owns the model weights, the KV cache, the req-to-token table, the FutureMap buffer
and the sampler. The scheduler launches a batch by sending its metadata over a pipe and goes
on with its own work; launches execute in order in the worker, and each pending result's
`wait()` receives that batch's sampled ids. A process, not a thread: with a thread the model's
Python dispatch and the scheduler's Python work serialize on the GIL and nothing overlaps.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import select
import sys
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection, wait

from batonlm import spawn
from batonlm.device import cpu_affinity
from batonlm.device.base import (
    DeviceError,
    DeviceStream,
    PendingResult,
)
from batonlm.device.spec import DeviceSpec
from batonlm.ipc import codec
from batonlm.ipc.device_messages import (
    BatchLaunch,
    BatchResult,
    IdleLaunch,
    LoRAMessage,
    SampleLaunch,
    WorkerFailed,
    WorkerProgress,
    WorkerReady,
    WorkerShutdown,
)

logger = logging.getLogger(__name__)

WORKER_START_TIMEOUT_S = 300.0

# How long an idle OpenMP thread of the worker spins before it sleeps (libgomp's GOMP_SPINCOUNT;
# its default, 300,000, is milliseconds). Between two parallel regions of a step the threads
# spin (the next region starts at once); between steps the worker's Python runs (sampling, the
# pipe) and its idle threads would spin through it on cores the scheduler and the frontend need.
# Measured on the 25M shape at one stream, 2 cores, side by side: ITL 3.43 -> 3.28 ms, server
# CPU a token 7.2 -> 6.4 ms, 16 streams unchanged (1024 vs 1034 tok/s); 3,000 and 30,000 the same.
# A GOMP_SPINCOUNT (or OMP_WAIT_POLICY) of the user's own is kept. Workers forked from a fork
# server (the test harness's, spawn.py) run on the libgomp the server loaded: its spin.
WORKER_GOMP_SPINCOUNT = "10000"


@contextlib.contextmanager
def worker_openmp_env() -> Iterator[None]:
    """The environment a worker starts in (libgomp reads it once, when torch loads it): this
    process's, with WORKER_GOMP_SPINCOUNT unless the user chose a spin or wait policy."""
    if "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ:
        yield
        return
    os.environ["GOMP_SPINCOUNT"] = WORKER_GOMP_SPINCOUNT
    try:
        yield
    finally:
        del os.environ["GOMP_SPINCOUNT"]


class _WorkerPending(PendingResult):
    def __init__(self, device: CpuWorkerDevice, batch_id: int) -> None:
        self.device = device
        self.batch_id = batch_id

    def wait(self) -> BatchResult:
        return self.device._collect(self.batch_id)


def wait_ready(conns: dict[int, Connection], procs: dict[int, mp.process.BaseProcess], progress) -> None:
    """Wait until every rank reports ready (`progress` gets their start-up steps, e.g. compiling
    the decode step); raise DeviceError naming the first rank that fails, exits, or stays silent
    for WORKER_START_TIMEOUT_S. Every rank is watched at once: one that dies while the others wait
    for it to join their group is reported as soon as it exits."""
    pending = dict(conns)
    deadline = time.monotonic() + WORKER_START_TIMEOUT_S

    def name(rank: int) -> str:
        return "the CPU device worker" if len(procs) == 1 and rank == 0 else f"tensor-parallel rank {rank}"

    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            raise DeviceError(f"{name(min(pending))} was silent for {WORKER_START_TIMEOUT_S:.0f} s while starting")
        ready = wait([*pending.values(), *(procs[r].sentinel for r in pending)], timeout=min(left, 1.0))
        for rank, conn in list(pending.items()):
            if conn in ready:
                try:
                    msg = codec.decode(conn.recv_bytes())
                except (EOFError, OSError):
                    msg = None
                if isinstance(msg, WorkerProgress):
                    progress(msg.message)
                    deadline = time.monotonic() + WORKER_START_TIMEOUT_S
                    continue
                if isinstance(msg, WorkerReady):
                    del pending[rank]
                    continue
                detail = getattr(msg, "message", None) or f"exit code {procs[rank].exitcode}"
                raise DeviceError(f"{name(rank)} failed to start: {detail}")
            if procs[rank].sentinel in ready:
                procs[rank].join(1.0)
                raise DeviceError(f"{name(rank)} exited while starting (exit code {procs[rank].exitcode})")


class CpuWorkerDevice(DeviceStream):
    """The device as worker processes: one on the CPU; with tensor parallelism one per rank of
    this node (on the CPU or one GPU each), rank 0 talking to the scheduler and relaying every
    message to the others (`batonlm/device/tp_ranks.py`)."""

    def __init__(self, spec: DeviceSpec) -> None:
        self.spec = spec
        ctx = mp.get_context("spawn")  # for the pipes: the processes' method is spawn.worker_process's
        self._results: dict[int, BatchResult] = {}
        self._closed = False
        self._failed = False  # a rank failed: close() kills the rest at once
        # Total seconds the worker spent computing batches (forward + sampling).
        self.compute_s = 0.0
        self._procs: dict[int, mp.process.BaseProcess] = {}
        self._startup: dict[int, Connection] = {}  # the other local ranks: their start-up reports
        for rank in spec.local_ranks:
            parent, child = ctx.Pipe(duplex=True)
            name = "batonlm-device" if spec.tp_size == 1 else f"batonlm-tp{rank}"
            self._procs[rank] = spawn.worker_process(worker_main, (child, spec, rank), name)
            with worker_openmp_env():
                spawn.start(self._procs[rank])
            child.close()
            if rank == 0:
                self._conn = parent
            else:
                self._startup[rank] = parent
        self._proc = self._procs[0]
        try:
            wait_ready({0: self._conn, **self._startup}, self._procs, logger.info)
        except DeviceError:
            self.close()
            raise
        for conn in self._startup.values():
            conn.close()
        # One poller for every result wait: the pipe, and each rank's exit (its sentinel), watched
        # together (a selector built per wait, as Connection.poll does, cost more than the wait).
        self._poller = select.poll()
        for fd in (self._conn.fileno(), *(p.sentinel for p in self._procs.values())):
            self._poller.register(fd, select.POLLIN)
        if spec.tp_size > 1:
            logger.info("tensor-parallel ranks of this node ready: %s (rendezvous %s)",
                        ", ".join(f"rank {r} pid {p.pid}" for r, p in self._procs.items()), spec.dist_init_addr)

    def check_health(self) -> None:
        """Raise DeviceError if a rank process of this node has exited."""
        for rank, proc in self._procs.items():
            if not proc.is_alive():
                self._failed = True
                what = "the CPU device worker" if self.spec.tp_size == 1 else f"tensor-parallel rank {rank}"
                raise DeviceError(f"{what} exited (exit code {proc.exitcode})")

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def _send(self, msg: codec.Message) -> None:
        try:
            self._conn.send_bytes(codec.encode(msg))
        except (BrokenPipeError, OSError) as e:
            raise DeviceError(f"CPU device worker is gone (exit code {self._proc.exitcode})") from e

    def _recv(self) -> object:
        try:
            # Rank 0 reports its own failures and those of ranks on other nodes (the pipe has its
            # message, or its end); a rank of this node that dies while rank 0 waits on it shows
            # here first (its sentinel).
            pipe, rank0 = self._conn.fileno(), self._procs[0].sentinel
            while True:
                ready = {fd for fd, _ in self._poller.poll(200)}
                # Rank 0's end (its sentinel may wake us before its pipe does, and before it can
                # be reaped): the pipe holds its last message, or closes with it.
                if pipe in ready or rank0 in ready:
                    break
                self.check_health()
            return codec.decode(self._conn.recv_bytes())
        except (EOFError, OSError) as e:
            self._proc.join(timeout=1.0)
            raise DeviceError(f"CPU device worker is gone (exit code {self._proc.exitcode})") from e

    def launch(self, launch: BatchLaunch) -> PendingResult:
        self._send(launch)
        return _WorkerPending(self, launch.batch_id)

    def launch_sampling(self, sample: SampleLaunch) -> None:
        self._send(sample)

    def launch_idle(self, idle: IdleLaunch) -> None:
        self._send(idle)

    def update_lora(self, msg: LoRAMessage) -> None:
        self._send(msg)

    def _collect(self, batch_id: int) -> BatchResult:
        # Results come back in launch order; keep any that arrive ahead of the one asked for.
        while batch_id not in self._results:
            msg = self._recv()
            if isinstance(msg, WorkerFailed):
                self._failed = True
                raise DeviceError(f"batch {msg.batch_id} failed on the CPU device: {msg.message}")
            assert isinstance(msg, BatchResult)
            self._results[msg.batch_id] = msg
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
        # Rank 0 relays the shutdown to the others. After a failure (a rank exited) the rest
        # may be stuck in a collective, or stopped: no waiting for them.
        failed = self._failed or any(p.exitcode not in (None, 0) for p in self._procs.values())
        deadline = time.monotonic() + (0.0 if failed else 5.0)
        for proc in self._procs.values():
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self._procs.values():
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5.0)
        self._conn.close()


def _die_with_parent() -> None:
    """SIGKILL this worker when the process that started it (the scheduler, or a node's
    supervisor) dies, whatever it is doing — a rank stuck in a collective (NCCL may never time
    out) would otherwise outlive its server."""
    try:
        import ctypes
        import signal

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL))
    except (OSError, AttributeError):  # not Linux/glibc: the pipe's EOF still ends an idle worker
        pass
    # A parent that died while this interpreter started (a cancelled start) sent no signal.
    if spawn.parent_gone():
        os._exit(0)


def _libc():
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return None


def keep_freed_memory() -> None:
    """glibc returns large freed blocks to the OS (mmap/trim), so every forward page-faults its
    multi-megabyte temporaries in again; measured on a 32M-parameter model at batch 64 that
    doubled the step time. Keep them in the heap instead (the worker's footprint is bounded by
    its largest forward)."""
    if (libc := _libc()) is not None:
        m_trim_threshold, m_mmap_threshold = -1, -3
        libc.mallopt(m_mmap_threshold, 1 << 30)
        libc.mallopt(m_trim_threshold, 1 << 30)


def _check_only_differentiating_guards() -> None:
    """Dynamo checks every guard of a compiled graph at each call (0.04 ms of stories260K's
    0.34 ms step at one row, 0.16 of the 25M shape's 3.8 ms). This process compiles nothing but
    the decode step, whose inputs are made the same way every step (CompiledDecode.run), so
    only the guards that tell its two graphs apart need checking: set for the whole process
    (torch's stance as a context would cost 0.06 ms a call)."""
    import torch

    torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)


def _release_start_up_memory() -> None:
    """Once, after loading and compiling: hand the heap's free pages back to the OS. What
    start-up freed (the checkpoint's read buffers, the compiler's working memory) would stay
    resident under keep_freed_memory's threshold for the server's life."""
    if (libc := _libc()) is not None:
        libc.malloc_trim(0)


def worker_main(conn: Connection, spec: DeviceSpec, rank: int = 0) -> None:
    """Entry point of a device worker process (tensor-parallel `rank`)."""
    import signal

    import torch

    # Ctrl-C (SIGINT), and SIGTERM from systemd or `kill -- -PGID`, reach the whole process group:
    # the scheduler shuts this worker down (or dies, and PDEATHSIG ends it), so neither may kill
    # it halfway (its end releases what it shares with the others).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent()
    cpu_affinity.take(spec.worker_cpus)  # before any thread of its own starts
    keep_freed_memory()
    # See factory.cpu_worker_threads: one thread for tiny models, all cores for larger ones.
    torch.set_num_threads(spec.cpu_threads)
    logging.basicConfig(level=os.environ.get("BATONLM_WORKER_LOG_LEVEL", "WARNING"))
    from batonlm.device.factory import build_executor
    from batonlm.device.tp_ranks import follow, join_group, serve_root

    tp = relay = mlp_group = None
    try:
        if spec.tp_size > 1:
            tp, relay, spec = join_group(spec, rank)
        if spec.dp_size > 1:  # DP attention: the MLP split over the data-parallel ranks' devices
            from batonlm.distributed.group import TPGroup

            mlp_group = TPGroup.init(spec.dp_rank, spec.dp_size, spec.dp_init_method, spec.dist_timeout,
                                     spec.rank_device(rank))
        progress = (lambda m: conn.send_bytes(codec.encode(WorkerProgress(m)))) if rank == 0 else None
        executor = build_executor(spec, progress, tp, mlp_group)
        _release_start_up_memory()
        if spec.compile_max_bs:
            _check_only_differentiating_guards()
        for group in (tp, mlp_group):  # loading takes each rank its own time: no heartbeat before all have
            if group is not None:
                group.wait_all("loaded")
    except Exception as e:  # report, then exit: the scheduler turns this into a start-up error
        logger.debug("device worker start-up failed", exc_info=True)
        conn.send_bytes(codec.encode(WorkerFailed(-1, f"{type(e).__name__}: {e}")))
        sys.exit(1)
    conn.send_bytes(codec.encode(WorkerReady()))
    if rank == 0:
        ok = serve_root(conn, executor, relay, spec)
    else:
        assert relay is not None  # ranks past 0 exist only with tensor parallelism (join_group made it)
        # Ranks on node 0 are watched by the scheduler's device; those on other nodes by their
        # node's supervisor, which reads heartbeats from this pipe.
        supervised = spec.local_ranks[0] != 0
        if not supervised:
            conn.close()
        ok = follow(executor, relay, spec, conn if supervised else None)
    for group in (tp, mlp_group):
        if group is not None:
            group.destroy()
    spawn.exit_child(0 if ok else 1)


