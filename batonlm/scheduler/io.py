"""How the scheduler talks to its frontend: a small interface, and its ZMQ implementation."""

from __future__ import annotations

import os
from collections import deque
from typing import Protocol

import zmq

from batonlm.ipc import codec
from batonlm.ipc.codec import Message


class SchedulerIO(Protocol):
    def recv(self, timeout_s: float) -> list[Message]:
        """Every message waiting; with `timeout_s > 0`, first block up to that long for one."""
        ...

    def send(self, msg: Message) -> None:
        """Send, or keep for later when the frontend is not reading: never blocks, never fails."""
        ...

    def writable(self, timeout_s: float) -> bool:
        """Send what `send` kept, waiting up to `timeout_s` for the frontend to read; whether
        nothing is left. The scheduler plans no new batch while it is False (back-pressure)."""
        ...

    @property
    def closed(self) -> bool:
        """True when no more requests can come."""
        ...

    @property
    def orphaned(self) -> bool:
        """True when the frontend is gone: nobody will read what is still running."""
        ...


class ZmqSchedulerIO:
    """PULL requests from the frontend, PUSH outputs to it, over `ipc://` endpoints.

    A frontend that stops reading (a stall on its event loop, GC, swap, a debugger) fills the
    PUSH socket's queue (its high-water mark, 1000 messages). What does not fit waits in a backlog
    here, and the scheduler plans no batch until the backlog is sent (`writable`): decoding pauses,
    nothing is lost, and the backlog stays within one or two iterations' outputs. Only a frontend
    that is gone (this process orphaned) has its outputs dropped."""

    def __init__(self, request_endpoint: str, output_endpoint: str) -> None:
        self._ctx = zmq.Context(1)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.connect(request_endpoint)
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 1000)
        self._push.connect(output_endpoint)
        self._backlog: deque[bytes] = deque()
        self._parent = os.getppid()
        self._closed = False

    @property
    def orphaned(self) -> bool:
        # The main process died without shutting us down.
        return os.getppid() != self._parent

    @property
    def closed(self) -> bool:
        return self._closed or self.orphaned

    def recv(self, timeout_s: float) -> list[Message]:
        out: list[Message] = []
        if timeout_s > 0 and not self._pull.poll(int(timeout_s * 1000)):
            return out
        # The socket's events say whether a message waits: asked every iteration, and cheaper
        # than a receive that raises zmq.Again (most iterations have nothing).
        while int(self._pull.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            try:
                data = self._pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            out.append(codec.decode(data))
        return out

    def send(self, msg: Message) -> None:
        self._backlog.append(codec.encode(msg))
        self._send_backlog()

    def _send_backlog(self) -> bool:
        while self._backlog:
            try:
                self._push.send(self._backlog[0], zmq.NOBLOCK)
            except zmq.Again:
                if self.orphaned:  # nobody will ever read them
                    self._backlog.clear()
                return False
            self._backlog.popleft()
        return True

    def writable(self, timeout_s: float) -> bool:
        if self._send_backlog():
            return True
        if timeout_s > 0:
            self._push.poll(int(timeout_s * 1000), zmq.POLLOUT)
        return self._send_backlog()

    def close(self) -> None:
        self._closed = True
        self.writable(1.0)  # the last outputs (a drain's aborts), if the frontend reads at all
        self._pull.close(0)
        self._push.close()
        self._ctx.term()
