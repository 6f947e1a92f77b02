"""SchedulerLink: the frontend's connection to its scheduler processes, one per data-parallel
replica (one without --dp): start them, send to one, receive what they send (request outputs
are handed on; stats and cache-flush answers go to whoever asked), notice one dying or failing,
and shut them down.

Each replica has its own request socket (ZMQ PUSH); their outputs share one (PULL).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import zmq
import zmq.asyncio

from batonlm.config import ServerArgs
from batonlm.ipc import codec
from batonlm.ipc.codec import Message
from batonlm.ipc.endpoints import new_endpoints
from batonlm.ipc.messages import (
    BatchOutput,
    FlushCacheResult,
    LoRAResult,
    SchedulerFailed,
    SchedulerInfo,
    SchedulerStats,
    ShutdownRequest,
)
from batonlm.tokenizer_manager.request_state import SchedulerGone

logger = logging.getLogger("batonlm.tokenizer_manager.manager")

SHUTDOWN_SEND_TIMEOUT_S = 2.0


class SchedulerProcess(Protocol):
    """The running scheduler, as the launcher hands it over."""

    process: Any  # a multiprocessing.Process
    info: SchedulerInfo

    def stop(self, timeout_s: float = 10.0) -> None: ...


# Starts a scheduler process given (args, ipc dir, request endpoint, output endpoint, data-parallel
# rank, an event that cancels the start: the process is killed and the call raises); the entry
# points pass batonlm.launcher.start_scheduler, so this package never imports the scheduler.
LaunchScheduler = Callable[[ServerArgs, str, str, str, int, threading.Event], SchedulerProcess]


class SchedulerLink:
    def __init__(
        self, args: ServerArgs, launch: LaunchScheduler, on_outputs: Callable[[BatchOutput], None],
        on_failure: Callable[[Exception], None],
    ) -> None:
        """`on_outputs` gets every BatchOutput; `on_failure` the error every waiting request
        must end with when a scheduler dies or fails (then `healthy` is False)."""
        self.args = args
        self._launch = launch
        self._on_outputs = on_outputs
        self._on_failure = on_failure
        self.on_death: Callable[[], None] | None = None  # a scheduler died (the server stops, exit 1)
        self.on_stop: Callable[[], None] | None = None  # a scheduler stopped when told to (the server stops)
        self.handles: list[SchedulerProcess] = []
        self.info: SchedulerInfo | None = None
        self.healthy = False
        self.last_heard = [time.monotonic()] * args.dp_size  # per replica: its last message
        # Per replica: futures waiting for its SchedulerStats / FlushCacheResult, in order.
        self._waiters: dict[type, list[list[asyncio.Future]]] = {
            kind: [[] for _ in range(args.dp_size)] for kind in (SchedulerStats, FlushCacheResult, LoRAResult)
        }
        self._ctx = zmq.asyncio.Context(1)
        self._pushes: list[zmq.asyncio.Socket] = []
        # Outputs arrive on a plain socket read from the event loop's own reader callback: every
        # waiting message at once, where zmq.asyncio's recv made a future, an enum's worth of
        # event flags and a task wake-up per message (a third of this process's CPU at one stream).
        self._pull: zmq.Socket | None = None
        self._pull_fd: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> SchedulerInfo:
        """Bind the sockets, spawn the scheduler(s), and wait until they have loaded the model."""
        self._loop = asyncio.get_running_loop()
        ipc_dir, _, out_ep = new_endpoints()
        req_eps = [f"ipc://{ipc_dir}/requests-{i}" for i in range(self.args.dp_size)]
        try:
            for ep in req_eps:
                push = self._ctx.socket(zmq.PUSH)
                push.setsockopt(zmq.LINGER, 0)
                push.bind(ep)
                self._pushes.append(push)
            self._pull = zmq.Socket(self._ctx, zmq.PULL)
            self._pull.bind(out_ep)
            self.handles = await self._start_replicas(ipc_dir, req_eps, out_ep)
        except BaseException:
            self._close_sockets()
            shutil.rmtree(ipc_dir, ignore_errors=True)
            raise
        self.info = self.handles[0].info
        self.healthy = True
        self._pull_fd = fd = int(self._pull.getsockopt(zmq.FD))
        self._loop.add_reader(fd, self._read_outputs)
        self._read_outputs()  # what came before the reader (the FD signals changes, not levels)
        for i, handle in enumerate(self.handles):
            self._loop.add_reader(handle.process.sentinel, self._scheduler_exited, i)
        return self.info

    async def _start_replicas(self, ipc_dir: str, req_eps: list[str], out_ep: str) -> list[SchedulerProcess]:
        """A thread per replica: DP attention's replicas meet while they start, so all of them
        must start at once (the default pool may have fewer threads than replicas). A cancelled
        start (Ctrl-C, SIGTERM) tells the threads, which kill their scheduler and return at
        once; one that had started already is stopped here, as are the others when one fails."""
        assert self._loop is not None
        cancel = threading.Event()
        ready: list[SchedulerProcess] = []

        def launch(i: int, ep: str) -> SchedulerProcess:
            handle = self._launch(self.args, ipc_dir, ep, out_ep, i, cancel)
            ready.append(handle)
            return handle

        pool = ThreadPoolExecutor(len(req_eps), thread_name_prefix="batonlm-start")
        try:
            started = await asyncio.gather(
                *(self._loop.run_in_executor(pool, launch, i, ep) for i, ep in enumerate(req_eps)),
                return_exceptions=True,
            )
        except BaseException:
            cancel.set()
            pool.shutdown(wait=True)
            for handle in ready:
                handle.process.kill()
                handle.stop(5.0)
            raise
        pool.shutdown(wait=True)
        failed = [r for r in started if isinstance(r, BaseException)]
        if failed:
            for handle in ready:  # the replicas that did start go too
                handle.process.kill()
                await asyncio.to_thread(handle.stop)
            raise failed[0]
        return started  # type: ignore[return-value]  # no exceptions among them

    async def shutdown(self) -> None:
        if not self.handles:
            return
        handles, self.handles = self.handles, []
        assert self._loop is not None  # start() set it before it made handles
        for handle in handles:  # before any await: a replica exiting now is no failure
            self._loop.remove_reader(handle.process.sentinel)

        async def tell(i: int, handle: SchedulerProcess) -> None:
            if handle.process.is_alive():
                # A scheduler that is exiting already (SIGTERM to the whole process group) has no
                # socket left: a PUSH send with no peer blocks for ever. stop() waits for it anyway.
                # Straight to its socket: after another replica died `send` refuses (not healthy),
                # and this replica would be left running.
                try:
                    await asyncio.wait_for(self._pushes[i].send(codec.encode(ShutdownRequest())), SHUTDOWN_SEND_TIMEOUT_S)
                except asyncio.TimeoutError:
                    logger.info("the scheduler did not take the shutdown request; waiting for it to exit")
            await asyncio.to_thread(handle.stop)

        await asyncio.gather(*(tell(i, h) for i, h in enumerate(handles)))
        self.healthy = False
        self._fail(SchedulerGone("the server is shutting down"))
        if self._pull_fd is not None:
            self._loop.remove_reader(self._pull_fd)
            self._pull_fd = None
        self._close_sockets()

    def kill(self) -> None:
        """Kill every scheduler now (stuck ones: a stopped process takes no request to stop);
        their exit is then noticed as a death."""
        self.healthy = False
        for handle in self.handles:
            handle.process.kill()

    def _close_sockets(self) -> None:
        for sock in (*self._pushes, self._pull):
            if sock is not None:
                sock.close(0)
        self._ctx.destroy(linger=0)  # any socket of the context still open is closed, not waited for

    def _scheduler_exited(self, replica: int) -> None:
        """A scheduler died: the server cannot serve (a replica's requests would hang)."""
        assert self._loop is not None
        handle = self.handles[replica]
        for h in self.handles:
            self._loop.remove_reader(h.process.sentinel)
        handle.process.join(1.0)  # reap it, for the exit code
        code = handle.process.exitcode
        which = "the scheduler process" if len(self.handles) == 1 else f"the scheduler of replica {replica}"
        self.healthy = False
        if code == 0:  # it was told to stop (a SIGTERM to the process group reaches it first): no failure
            logger.info("%s has stopped", which)
            self._fail(SchedulerGone("the server is shutting down"))
            if self.on_stop is not None:
                self.on_stop()
            return
        logger.error("%s exited unexpectedly (exit code %s)", which, code)
        self._fail(SchedulerGone(f"the scheduler process died (exit code {code})"))
        if self.on_death is not None:
            self.on_death()

    def _fail(self, error: Exception) -> None:
        """End every waiting request and question with `error`."""
        self._on_failure(error)
        for per_replica in self._waiters.values():
            for waiters in per_replica:
                for fut in waiters:
                    if not fut.done():
                        fut.set_exception(error)
                waiters.clear()

    # ------------------------------------------------------------------ IO
    async def send(self, msg: Message, replica: int = 0) -> None:
        if not self.healthy:
            raise SchedulerGone("the scheduler is not running")
        await self._pushes[replica].send(codec.encode(msg))

    def send_nowait(self, msg: Message, replica: int) -> asyncio.Future:
        """Send without awaiting (safe in cancelled tasks); the future says whether it went."""
        # pyzmq annotates send() as returning an Awaitable; it is an asyncio Future, passed through.
        return asyncio.ensure_future(self._pushes[replica].send(codec.encode(msg), flags=zmq.NOBLOCK))

    async def ask_all(self, msg: Message, answer: type, timeout_s: float) -> list:
        """Send `msg` to every replica; their answers (of type `answer`), in replica order."""
        futs = []
        for i in range(len(self._pushes)):
            fut: asyncio.Future = asyncio.get_running_loop().create_future()
            self._waiters[answer][i].append(fut)
            futs.append(fut)
            await self.send(msg, i)
        return await asyncio.wait_for(asyncio.gather(*futs), timeout_s)

    def _read_outputs(self) -> None:
        """The output socket's FD fired (edge-triggered: it says something changed): take every
        message waiting."""
        pull = self._pull
        while pull is not None and not pull.closed and int(pull.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            try:
                data = pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle(codec.decode(data))

    def _handle(self, msg: Message) -> None:
        """One message from a scheduler: outputs handed on, answers to whoever asked, a failure."""
        if isinstance(msg, BatchOutput | SchedulerStats):
            self.last_heard[msg.dp_rank] = time.monotonic()
        if isinstance(msg, BatchOutput):
            self._on_outputs(msg)
        elif isinstance(msg, SchedulerStats | FlushCacheResult | LoRAResult):
            waiters = self._waiters[type(msg)][msg.dp_rank]
            if waiters:
                fut = waiters.pop(0)
                if not fut.done():
                    fut.set_result(msg)
        elif isinstance(msg, SchedulerFailed):
            # The details are for the log; clients learn that the server cannot serve them.
            logger.error("scheduler failed: %s", msg.message)
            self.healthy = False
            self._fail(SchedulerGone("the scheduler failed (the server log has the details)"))
